"""Where the optimizer lives between steps (``[memory] optimizer``): the Engine's one surface for
``OptimizerMirror`` (stream) and ``HostMirror`` (mirror)."""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch


class OptimizerResidency(Protocol):
    """The Engine calls ``begin_step`` before forward, ``listen`` once (gradients as each
    bucket's exchange ends), ``scale_gradients`` (clipping, fp16 unscaling) and ``step``;
    ``resident`` hands the state back for checkpoints and bucket rebuilds."""

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
        bringing it into memory, or None (then ``resident`` is used)."""
        ...

    def close(self) -> None: ...


class StepMirror:
    """What both mirrors share: the optimizer's ``step`` taken over, and ``resident``."""

    optimizer: torch.optim.Optimizer
    num_resident: int

    def materialize(self) -> None:
        """Every state tensor back in the optimizer (for code that reads or replaces it)."""
        raise NotImplementedError

    def evict(self) -> None:
        """The state out of the optimizer again, where the mirror keeps it."""
        raise NotImplementedError

    @contextmanager
    def resident(self) -> Iterator[None]:
        """The whole state in the optimizer inside the block (checkpoints, rebuilds)."""
        self.num_resident += 1
        self.materialize()
        try:
            yield
        finally:
            self.evict()

    def _take_step(self) -> None:
        # The instance attribute shadows the class's step for every caller (strategies, LR
        # schedulers, which wrap ``optimizer.step`` in turn through its __func__).
        self.optimizer.step = types.MethodType(_mirrored_step, self.optimizer)  # type: ignore[method-assign]
        self.optimizer._phalanx_mirror = self  # type: ignore[attr-defined]

    def _release_step(self) -> None:
        if self.optimizer.__dict__.get("step") is not None:
            del self.optimizer.step  # an LR scheduler's wrapper, if any, goes with it
        del self.optimizer._phalanx_mirror  # type: ignore[attr-defined]


def _mirrored_step(optimizer: torch.optim.Optimizer, closure: Any = None) -> None:
    if closure is not None:
        raise ValueError("the host optimizer mirror steps without a closure")
    optimizer._phalanx_mirror.step()  # type: ignore[attr-defined]
