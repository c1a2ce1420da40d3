"""One layer's measured cost, the one per-layer type that the pipeline split, the memory plan,
the fusion threshold and the planner read (from the profiler, the live gradient-ready times or
published figures); a producer leaves what it did not measure at 0."""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """Seconds of one micro-batch through the layer, and bytes it holds or produces."""

    name: str = ""  # its name in the model (the Sequential's index)
    forward_s: float = 0.0
    backward_s: float = 0.0  # from its output's gradient being ready to its input's
    param_bytes: int = 0  # its own parameters
    output_bytes: int = 0  # its output activation (what a pipeline boundary after it carries)
    saved_bytes: int = 0  # what autograd saves in its forward (offload / recompute frees it)
    # what its backward allocates above what it started with, at its highest (its input's
    # gradient, temporaries); 0: not measured (the plan then counts input + output instead)
    backward_work_bytes: int = 0
    input_bytes: int = 0  # its input activation (what recompute keeps instead)
    # each of its gradients' bytes, in the order they are ready when its backward ends (the
    # planner's step: a "layer" there may be a group of layers)
    grad_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.forward_s < 0 or self.backward_s < 0:
            raise ConfigError(f"layer {self.name!r}: times must be >= 0 seconds")
        if any(n < 0 for n in self.grad_bytes):
            raise ConfigError(f"layer {self.name!r}: gradient bytes must be >= 0")

    @property
    def seconds(self) -> float:
        """Forward + backward."""
        return self.forward_s + self.backward_s
