"""The step's global loss (``engine.stats.loss``): the mean over every rank that computes one,
without a collective of its own where the step already makes one.

Phases, as the Engine calls them:
  Phase 2 (``start``, before the last backward): this rank's (loss x reports, reports, stop
    vote) leave (the vote: ``Engine.request_stop``, a preempted run's SIGTERM; the Trainer
    reads the sum, so every rank stops at the same step with no collective of its own):
    riding in the strategy's verdict all-reduce where it makes one over every rank
    (``partitioned``), else in an all-reduce of their own that travels while backward runs.
  Phase 4 (``riders``): the sums for the verdict's message, taken once.
  Phase 5 (``finish``): the mean; a step skipped before its verdict sends the sums alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.context import Context


class GlobalLoss:
    """``world``: every rank of the job; ``keep``: where the finished all-reduce's Work goes
    (the Engine's teardown holds it: a backend thread must never drop the last reference)."""

    def __init__(self, world: Context, keep: Callable[[list[Any]], None]) -> None:
        self.world, self._keep = world, keep
        # [sum of the reporting ranks' losses, their count, stop votes], float64 on the device
        self._sums = torch.zeros(3, dtype=torch.float64, device=world.device)
        self.stop_votes = 0  # the last finished step's (every rank sees the same number)
        self._work: Any = None
        self.started = False  # this step's sums have left (or are waiting to ride)
        self._rides = False  # they ride in the strategy's verdict

    # Phase 2
    def start(self, loss: torch.Tensor, reports: bool, rides: bool, stop: bool = False) -> None:
        """``loss``: this rank's 0-dim loss; ``reports``: whether it counts (a trainer holding
        the last stage); ``rides``: whether the strategy's verdict all-reduces over every
        rank this step; ``stop``: this rank's stop vote."""
        self._sums[0] = loss.detach().to(torch.float64) * float(reports)
        self._sums[1] = float(reports)
        self._sums[2] = float(stop)
        self.started, self._rides = True, rides
        if self.world.world_size > 1 and not rides:
            self._work = dist.all_reduce(self._sums, group=self.world.group, async_op=True)

    # Phase 4
    def riders(self) -> torch.Tensor | None:
        """The sums to add to the verdict's all-reduce (summed there in place), once."""
        if not self._rides:
            return None
        self._rides = False
        return self._sums

    # Phase 5
    def finish(self) -> float:
        self.started = False
        if self._rides:  # the step was skipped before its verdict: the sums go alone
            dist.all_reduce(self._sums, group=self.world.group)
            self._rides = False
        if self._work is not None:
            self._work.wait()
            self._keep([self._work])  # until the next step, then the teardown's
            self._work = None
        total, count, votes = self._sums.tolist()
        self.stop_votes = round(votes)
        return total / count if count else float("nan")
