"""The training step: the Engine and the components it calls at fixed points of a step.

core (the Engine: construction and the step's phases), config (StepConfig and the keyword
shorthand), checks (argument checks), slot (the one holder of the current strategy), guard
(non-finite verdict, clipping), global_loss, hooks, teardown, batches, tracing,
auto_bucketing (``bucket_mb = "auto"``), pipeline_driver (Phase 2 with pipeline > 1),
ownership (the user's optimizer and who may step it), state (checkpoints and whole reads).
"""

from phalanx.engine.config import StepConfig
from phalanx.engine.core import Engine

__all__ = ["Engine", "StepConfig"]
