"""Pipeline schedules, registered by name, each backed by torch.distributed.pipelining.

A schedule kind knows which torch class runs it, whether a rank holds one stage or several
(virtual stages), and its theoretical bubble fraction for the benchmark.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phalanx.registry import Registry


@dataclass(frozen=True)
class ScheduleKind:
    """One pipeline schedule: ``torch_class`` names the class in
    torch.distributed.pipelining.schedules; ``multi_stage`` schedules take a list of stages
    per rank (``virtual_stages`` of them)."""

    name: str
    torch_class: str
    multi_stage: bool
    description: str

    def build(self, stages: list[Any], num_microbatches: int, loss_fn: Callable) -> Any:
        """The torch schedule object over this rank's ``stages``. Gradients are not rescaled
        by torch (``scale_grads=False``): the loss already carries 1 / (micro-batches x D)."""
        from torch.distributed.pipelining import schedules

        cls = getattr(schedules, self.torch_class)
        target = stages if self.multi_stage else stages[0]
        try:
            return cls(target, num_microbatches, loss_fn=loss_fn, scale_grads=False)
        except TypeError:  # torch releases before scale_grads: they never rescaled
            return cls(target, num_microbatches, loss_fn=loss_fn)

    def bubble_fraction(self, num_ranks: int, num_microbatches: int, virtual: int = 1) -> float:
        """The idle share of a step in theory: (P-1)/(M+P-1) for GPipe and 1F1B; virtual
        stages divide the bubble's length by ``virtual`` (interleaved 1F1B)."""
        p, m, v = num_ranks, num_microbatches, virtual if self.multi_stage else 1
        bubble = (p - 1) / v
        return bubble / (m + bubble)


SCHEDULES: Registry[ScheduleKind] = Registry("pipeline schedule")


def _register(kind: ScheduleKind) -> None:
    SCHEDULES.register(kind.name)(lambda: kind)


_register(ScheduleKind("gpipe", "ScheduleGPipe", False, "all forwards, then all backwards"))
_register(ScheduleKind("1f1b", "Schedule1F1B", False, "one forward, one backward (less memory)"))
_register(
    ScheduleKind(
        "interleaved", "ScheduleInterleaved1F1B", True, "1F1B over virtual stages (smaller bubble)"
    )
)
_register(
    ScheduleKind("looped_bfs", "ScheduleLoopedBFS", True, "breadth-first over virtual stages")
)


def schedule_kind(name: str) -> ScheduleKind:
    return SCHEDULES.get(name)()
