"""The training step: the Engine and the components it calls at fixed points of a step.

core (the Engine: construction and the step's phases), config (StepConfig and the keyword
shorthand), checks (argument checks), slot (the one holder of the current strategy), guard
(non-finite verdict, clipping), global_loss, hooks, teardown, batches, tracing,
auto_bucketing (``bucket_mb = "auto"``), pipeline_driver (Phase 2 with pipeline > 1),
ownership (who may step the optimizer), state (checkpoints).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from phalanx.engine.config import StepConfig

if TYPE_CHECKING:
    from phalanx.engine.core import Engine

__all__ = ["Engine", "StepConfig"]


def __getattr__(name: str) -> Any:
    # The Engine is imported on first use: lower layers (the run config, the planner) import
    # this package's small modules without pulling in the Engine's whole import graph.
    if name == "Engine":
        from phalanx.engine.core import Engine

        return Engine
    raise AttributeError(f"module 'phalanx.engine' has no attribute {name!r}")
