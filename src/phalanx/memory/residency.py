"""Where the optimizer lives between steps (``[memory] optimizer``): the one surface the Engine
uses for both ``OptimizerMirror`` (state streamed from a memory tier, chunk by chunk) and
``HostMirror`` (fp32 masters, state and the step on the host)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol


class OptimizerResidency(Protocol):
    """Phases of one step, as the Engine calls them:
      Phase 1 (``begin_step``): before forward; the previous step's work may still run.
      Phase 2 (``listen`` set up once): gradients reach it as each bucket's exchange ends.
      Phase 3 (``scale_gradients``): clipping / fp16 unscaling of what it already holds.
      Phase 4 (``step``): the update, on the tier or the host.
    ``sync`` waits for background work, ``resident`` hands the state back for checkpoints and
    bucket rebuilds, ``lazy_shards`` describes it for a checkpoint that reads it piece by
    piece, ``stored_bytes`` is what lives outside device memory."""

    num_chunks_stepped: int  # chunks of parameters updated so far (benches, tests)

    def listen(self, strategy: Any) -> None: ...

    def begin_step(self) -> None: ...

    def scale_gradients(self, factor: float) -> None: ...

    def step(self) -> None: ...

    def sync(self) -> None: ...

    def resident(self) -> AbstractContextManager[None]: ...

    def stored_bytes(self) -> int: ...

    def lazy_shards(
        self, params: list[Any]
    ) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]] | None:
        """The state in ``OptimizerSharding.optimizer_shards``' form for a checkpoint without
        bringing it into memory (per-element state as ``LazySlices``), or None where it
        cannot (then ``resident`` is used)."""
        ...

    def close(self) -> None: ...
