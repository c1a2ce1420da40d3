"""Mixed precision: autocast for forward (bf16: no scaling, fp32's range); for fp16
torch.amp.GradScaler's dynamic loss scale (an overflow skips the step and halves it;
``growth_interval`` good steps double it), kept here because its inf check must be the verdict
all ranks agreed on and the gradients to unscale live in the exchange's buckets or at owners.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from phalanx.errors import ConfigError

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast and loss scale of one Engine (the scale is 1 unless fp16)."""

    def __init__(
        self,
        name: str,
        device: torch.device,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
    ) -> None:
        if name not in DTYPES:
            raise ConfigError(f"precision: got {name!r}; allowed: {', '.join(DTYPES)}")
        self.name, self.device = name, device
        self.dtype = DTYPES[name]
        self.scaled = name == "fp16"
        self.scale = init_scale if self.scaled else 1.0
        self.growth_interval = growth_interval
        self._good_steps = 0

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's context: autocast to the low-precision dtype, or nothing for fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def update(self, overflow: bool) -> None:
        """After a step: halve the scale on overflow, double it after enough good steps."""
        if not self.scaled:
            return
        if overflow:
            self.scale *= 0.5
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps == self.growth_interval:
            self.scale *= 2.0
            self._good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state.get("scale", self.scale))
        self._good_steps = int(state.get("good_steps", 0))
