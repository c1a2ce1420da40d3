"""Pipeline schedules, registered by name, each backed by torch.distributed.pipelining: its
class, stage placement, accepted micro-batch counts and theoretical bubble."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from phalanx.fields import require
from phalanx.registry import Registry


@dataclass(frozen=True, kw_only=True)
class ScheduleKind:
    """One pipeline schedule (docs/parallel.md describes each)."""

    name: str
    torch_class: str  # in torch.distributed.pipelining.schedules
    multi_stage: bool  # takes a list of stages per rank
    description: str
    placement: Literal["loop", "v"] = "loop"  # stage s on rank s % P; or r and 2P-1-r on rank r
    stages_per_rank: int = 0  # exactly this many (0: virtual_stages)
    microbatches_per_rank: int = 0  # torch needs M >= this x P
    whole_rounds: bool = False  # torch needs M a multiple of max(1, M // P) (rounds of about P)
    split_backward: bool = False  # input-gradient pass, then a weight-gradient pass in the bubble
    bubble_share: float = 1.0  # of 1F1B's bubble claimed with F = B = W (ZB-H1 1/3, ZB-V 0)
    # The oldest torch release it runs on here: torch 2.11's split-backward schedules stop
    # at their first step on Gloo ("Pair is not connected"); 2.13's run and are tested.
    min_torch: tuple[int, int] = (0, 0)

    def build(self, stages: list[Any], num_microbatches: int, loss_fn: Callable) -> Any:
        """The torch schedule object over this rank's ``stages``. Gradients are not rescaled
        by torch (``scale_grads=False``): the loss already carries 1 / (micro-batches x D)."""
        cls = _torch_schedules()[self.torch_class]
        target = stages if self.multi_stage else stages[0]
        try:
            return cls(target, num_microbatches, loss_fn=loss_fn, scale_grads=False)
        except TypeError:  # torch releases before scale_grads: they never rescaled
            return cls(target, num_microbatches, loss_fn=loss_fn)

    @property
    def available(self) -> bool:
        """Whether the installed torch has this schedule's class and is new enough."""
        return self.torch_class in _torch_schedules() and self.new_enough

    @property
    def new_enough(self) -> bool:
        major, minor = (int(n) for n in _torch_version().split(".")[:2])
        return (major, minor) >= self.min_torch

    def num_local_stages(self, virtual_stages: int) -> int:
        """Stages each pipeline rank runs."""
        if not self.multi_stage:
            return 1
        return self.stages_per_rank or virtual_stages

    def rank_of_stage(self, stage: int, num_ranks: int) -> int:
        """The pipeline rank running ``stage``."""
        if self.placement == "v" and stage >= num_ranks:  # the V's way back
            return 2 * num_ranks - 1 - stage
        return stage % num_ranks

    def check(self, num_ranks: int, num_microbatches: int, virtual_stages: int) -> None:
        """Each constraint on the layout as a ConfigValueError (torch raises them mid-build)."""
        p, m, name = num_ranks, num_microbatches, self.name
        others = ", ".join(n for n in SCHEDULES.names() if schedule_kind(n).available)
        require(
            self.new_enough,
            "schedule",
            f"{name!r} needs torch >= {self.min_torch[0]}.{self.min_torch[1]} here (older "
            f"releases stop at its first step on Gloo), torch {_torch_version()} is installed; "
            f"upgrade torch or choose one of: {others}",
        )
        require(
            self.available,
            "schedule",
            f"{name!r} needs torch.distributed.pipelining.schedules.{self.torch_class}, which "
            f"torch {_torch_version()} lacks; upgrade torch or choose one of: {others}",
        )
        require(
            not self.stages_per_rank or virtual_stages == self.stages_per_rank,
            "virtual_stages",
            f"{name} runs exactly {self.stages_per_rank} stages per pipeline rank "
            f"({self.placement}-shaped), got {virtual_stages}; set virtual_stages = "
            f"{self.stages_per_rank}",
        )
        least = self.microbatches_per_rank * p
        require(
            m >= least,
            "microbatches",
            f"{name} needs at least {self.microbatches_per_rank} x pipeline = {least} "
            f"micro-batches, got {m}",
        )
        rounds = max(1, m // p)
        require(
            not self.whole_rounds or m % rounds == 0,
            "microbatches",
            f"{name} runs rounds of about pipeline = {p} micro-batches and needs a multiple "
            f"of {rounds} rounds, got {m}; use a multiple of {p} or fewer than {2 * p}",
        )

    def bubble_fraction(self, num_ranks: int, num_microbatches: int, virtual: int = 1) -> float:
        """The idle share of a step in theory: (P-1)/(M+P-1) for 1F1B, bubble / ``virtual``
        stages, times ``bubble_share``."""
        p, m, v = num_ranks, num_microbatches, self.num_local_stages(virtual)
        bubble = self.bubble_share * (p - 1) / v
        return bubble / (m + bubble)


SCHEDULES: Registry[ScheduleKind] = Registry("pipeline schedule")


def _register(kind: ScheduleKind) -> None:
    SCHEDULES.register(kind.name)(lambda: kind)


def schedule_kind(name: str) -> ScheduleKind:
    return SCHEDULES.get(name)()


@functools.cache
def _torch_schedules() -> dict[str, Any]:
    """The schedule classes of the installed torch by name, imported on first use:
    torch.distributed.pipelining takes ~1.7 s to import (it loads torch._dynamo)."""
    from torch.distributed.pipelining import schedules

    return {name: getattr(schedules, name) for name in dir(schedules) if name.startswith("Sched")}


def _torch_version() -> str:
    import torch

    return torch.__version__


# fmt: off
for _kind in (
    ScheduleKind(name="gpipe", torch_class="ScheduleGPipe", multi_stage=False,
                 description="all forwards, then all backwards"),
    ScheduleKind(name="1f1b", torch_class="Schedule1F1B", multi_stage=False,
                 description="one forward, one backward (less memory)", microbatches_per_rank=1),
    ScheduleKind(name="interleaved", torch_class="ScheduleInterleaved1F1B", multi_stage=True,
                 description="1F1B over virtual stages (smaller bubble)", whole_rounds=True),
    ScheduleKind(name="looped_bfs", torch_class="ScheduleLoopedBFS", multi_stage=True,
                 description="breadth-first over virtual stages"),
    ScheduleKind(name="interleaved_zb", torch_class="ScheduleInterleavedZeroBubble",
                 multi_stage=True, whole_rounds=True, split_backward=True, bubble_share=1 / 3,
                 description="interleaved 1F1B whose weight gradients fill the bubble (ZB-H1)",
                 min_torch=(2, 13)),
    ScheduleKind(name="zbv", torch_class="ScheduleZBVZeroBubble", multi_stage=True,
                 description="zero bubble over two stages per rank in a V (ZB-V)", placement="v",
                 stages_per_rank=2, split_backward=True, bubble_share=0.0, min_torch=(2, 13)),
    ScheduleKind(name="dualpipev", torch_class="ScheduleDualPipeV", multi_stage=True, description=
                 "DeepSeek's DualPipe cut in half: a V with forward and backward paired",
                 placement="v", stages_per_rank=2, microbatches_per_rank=2, split_backward=True,
                 bubble_share=0.0, min_torch=(2, 13)),
):
    _register(_kind)
# fmt: on
