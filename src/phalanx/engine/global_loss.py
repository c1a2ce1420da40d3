"""The step's global loss (``engine.stats.loss``): the mean over every rank that computes one,
without a collective of its own where the step already makes one.

Phases, as the Engine calls them:
  Phase 2 (``start``, before the last backward): this rank's (loss x reports, reports, stop
    vote) leave (the vote: ``Engine.request_stop``, a preempted run's SIGTERM; the Trainer
    reads the sum, so every rank stops at the same step with no collective of its own), by
    the first carrier that applies: the last gradient bucket's rider slots where the
    strategy sums whole buckets (``allreduce``, ``tree``), the strategy's verdict all-reduce
    where it makes one over every rank (``partitioned``, ``fsdp``), else an all-reduce of
    their own that travels while backward runs.
  Phase 4 (``riders``): the sums for the verdict's message, taken once.
  Phase 5 (``finish``): the mean; sums whose carrier did not travel (a step skipped before
    its exchange) go alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.context import Context

SLOTS = 3  # [sum of the reporting ranks' losses, their count, stop votes]
BUCKET, VERDICT, OWN = "bucket", "verdict", "own"  # the carriers, in order of preference


class GlobalLoss:
    """``world``: every rank of the job; ``keep``: where the finished all-reduce's Work goes
    (the Engine's teardown holds it: a backend thread must never drop the last reference)."""

    def __init__(self, world: Context, keep: Callable[[list[Any]], None]) -> None:
        self.world, self._keep = world, keep
        # the SLOTS sums, float64 on the device (or the last bucket's slots while they ride)
        self._sums = torch.zeros(SLOTS, dtype=torch.float64, device=world.device)
        self.stop_votes = 0  # the last finished step's (every rank sees the same number)
        self._work: Any = None
        self.started = False  # this step's sums have left (or are waiting to ride)
        self._carrier = OWN
        self._slots: torch.Tensor | None = None

    # Phase 2
    def start(
        self,
        loss: torch.Tensor,
        reports: bool,
        stop: bool = False,
        *,
        slots: torch.Tensor | None = None,
        verdict: bool = False,
    ) -> None:
        """``loss``: this rank's 0-dim loss; ``reports``: whether it counts (a trainer holding
        the last stage); ``stop``: this rank's stop vote. Carriers: ``slots`` (SLOTS elements
        of the last bucket, fp32/fp64, launched after this call on every rank) or ``verdict``
        (the strategy's verdict all-reduces over every rank this step); else its own."""
        self._sums[0] = loss.detach().to(torch.float64) * float(reports)
        self._sums[1] = float(reports)
        self._sums[2] = float(stop)
        self.started, self._slots = True, None
        self._carrier = BUCKET if slots is not None else VERDICT if verdict else OWN
        if slots is not None:
            slots.copy_(self._sums)  # summed over the ranks with the bucket's gradients
            self._slots = slots
        elif self.world.world_size > 1 and not verdict:
            self._work = dist.all_reduce(self._sums, group=self.world.group, async_op=True)

    # Phase 4
    def riders(self) -> torch.Tensor | None:
        """The sums to add to the verdict's all-reduce (summed there in place), once."""
        if self._carrier != VERDICT:
            return None
        self._carrier = OWN
        return self._sums

    # Phase 5
    def finish(self, exchanged: bool = True) -> float:
        """``exchanged``: whether this step's buckets travelled (False: skipped before)."""
        self.started = False
        if self._carrier == BUCKET and exchanged:
            assert self._slots is not None
            self._sums.copy_(self._slots)
        elif self._carrier != OWN and self.world.world_size > 1:  # the carrier never left
            dist.all_reduce(self._sums, group=self.world.group)
        self._carrier, self._slots = OWN, None
        if self._work is not None:
            self._work.wait()
            self._keep([self._work])  # until the next step, then the teardown's
            self._work = None
        total, count, votes = self._sums.tolist()
        self.stop_votes = round(votes)
        return total / count if count else float("nan")


def rider_slots(sums_whole_buckets: bool, pipeline: Any, model: torch.nn.Module) -> int:
    """Slots for the global loss in the last bucket: where the strategy sums whole buckets
    exactly (``sums_whole_buckets``: uncompressed) over the world (no ``pipeline``) in fp32 or
    fp64 (a bf16 bucket would round the loss)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    exact = all(p.dtype in (torch.float32, torch.float64) for p in trained)
    return SLOTS if sums_whole_buckets and pipeline is None and exact else 0
