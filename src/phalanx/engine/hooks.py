"""StepHook: the protocol of the Engine's components that act at fixed points of every step.

The Engine (phalanx.engine) calls its hooks in the order it holds them, at:
  Phase 1, ``begin(step)``: before the step's first forward (``step``: 1-based index).
  Phase 2, ``before_backward(last)`` / ``after_backward()``: around each micro-batch's backward
    (``last``: the backward whose buckets launch the exchange).
  Phase 4, ``after_exchange()``: every bucket's exchange finished (not on a step skipped for a
    bad loss before the exchange).
  Phase 5, ``end(step)``: after the update or the skip (``StepEnd``).
Components override what they need; the rest are no-ops. Hooks run on every rank alike (a hook
may make collective calls where the step is the same on every rank: ``end`` of an update).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from phalanx.metrics import StepStats


@dataclass(frozen=True)
class StepEnd:
    """What the Engine tells its hooks at the end of a step."""

    step: int  # 1-based index of the step that ended
    updated: bool  # False: skipped (inf/NaN loss or gradients on some rank), the same everywhere
    num_updates: int  # updates applied before this step's
    stats: StepStats  # this step's timings and bytes


class StepHook(Protocol):
    """A component of the Engine's step (see the module docstring for when each runs)."""

    def begin(self, step: int) -> None:
        return None

    def before_backward(self, last: bool) -> None:
        return None

    def after_backward(self) -> None:
        return None

    def after_exchange(self) -> None:
        return None

    def end(self, step: StepEnd) -> None:
        return None
