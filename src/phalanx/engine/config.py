"""StepConfig: how the Engine runs one step (micro-batches, precision, buffers, the guard).

``[train]`` (phalanx.config.TrainConfig) extends it with the loop's keys, so a config run hands
its ``train`` table to the Engine as it is; the Python API's keyword shorthand
(``Engine(..., accumulate_steps=4)``) builds the same object with the same checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from phalanx.engine.guard import GuardConfig
from phalanx.fields import option, require


@dataclass(kw_only=True)
class StepConfig(GuardConfig):
    """The step's options; the non-finite guard's come from GuardConfig."""

    accumulate_steps: int = option(1, "micro-batches per step; exchange only after the last")
    precision: Literal["fp32", "bf16", "fp16"] = option(
        "fp32", "forward under torch.autocast: bf16, or fp16 with a dynamic loss scale"
    )
    broadcast_buffers: bool = option(
        True,
        "rank 0's buffers (BatchNorm statistics) to every rank at the end of each update, so "
        "the next forward (training or evaluation) and any checkpoint see rank 0's, as DDP",
    )
    compile: bool = option(
        False,
        "torch.compile each layer's forward (the strategy's hooks stay outside the compiled "
        "code); compiles in the first step, whose compile time is reported once (compile_s)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.accumulate_steps >= 1,
            "accumulate_steps",
            f"must be >= 1, got {self.accumulate_steps}",
        )
