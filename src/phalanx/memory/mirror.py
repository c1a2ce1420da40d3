"""F19: the optimizer's state lives in the next tier and streams through memory chunk by chunk.

``OptimizerMirror(optimizer, tier)`` keeps every parameter's large state tensors (Adam's
``exp_avg`` / ``exp_avg_sq``, SGD's momentum buffer, AdaGrad's sums) in a tier between steps:
pinned host memory on CUDA, a spill file on local disk on a CPU-only machine. Only small state
(step counters) stays resident. Any strategy's optimizer works unchanged: the mirror replaces
the instance's ``step`` (so sharded owners and parameter servers, which build the optimizer on
their own shard and call ``step`` themselves, step through it too) and steps the optimizer once
per chunk with only that chunk's gradients visible. The optimizer must be elementwise per
parameter (SGD, Adam, AdamW, AdaGrad, RMSprop...), as ZeRO-Offload's are; its step hooks run
once per chunk.

Phases of ``step``:
  Phase 1: the parameters with a gradient are grouped, in the optimizer's order, into chunks of
    about ``chunk_bytes`` of state; the read of chunk 0's state is queued.
  Phase 2 (per chunk i): wait for chunk i's state and queue chunk i+1's read (prefetch: the tier
    reads while this chunk steps); the state tensors are views into the loaded buffer.
  Phase 3: step the optimizer with only chunk i's gradients visible; it updates the views, so
    the same buffer, now holding the new state, is queued for writing and dropped from the
    optimizer. At most two writes are in flight: the write of chunk i overlaps chunk i+1's step.
  Phase 4: gradients are restored; the last writes complete before the next read of the same
    state (the tier serves requests in order).

Tensors cross the tier as 1-D uint8 (each state tensor's bytes at a 64-byte aligned offset) on
the optimizer's device; ``materialize()`` brings every state back (checkpoints, bucket
rebuilds), ``evict()`` sends it out again.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.memory.tiers import Loaded, Slot, Tier

ALIGN_BYTES = 64  # every state tensor starts at a multiple of this in a chunk's buffer
MIN_OFFLOAD_ELEMENTS = 2  # smaller state (step counters) stays resident


@dataclass(frozen=True)
class _Entry:
    """One offloaded state tensor: its parameter, key, dtype, shape and byte range."""

    param: torch.Tensor
    key: str
    dtype: torch.dtype
    shape: torch.Size
    offset: int
    nbytes: int


@dataclass(eq=False)
class _Stored:
    """A chunk's state in the tier: the slot and how to cut it back into tensors."""

    slot: Slot
    entries: list[_Entry]


class OptimizerMirror:
    """The optimizer's state in ``tier`` between steps (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, tier: Tier, chunk_bytes: int) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes: must be >= 1, got {chunk_bytes}")
        self.optimizer = optimizer
        self.tier = tier
        self.chunk_bytes = chunk_bytes
        self._chunks: list[list[torch.Tensor]] = []  # fixed at the first eviction
        self._stored: dict[int, _Stored] = {}  # chunk index -> its state in the tier
        self._loaded: dict[int, torch.Tensor] = {}  # chunk index -> buffer its state views
        self._writes: list[Future] = []
        self.num_chunks_stepped = 0
        self.num_resident = 0  # resident() blocks entered (checkpoints, sharded rebuilds)
        self._original_step = optimizer.step
        # The instance attribute shadows the class's step for every caller (strategies, LR
        # schedulers, which wrap ``optimizer.step`` in turn through its __func__).
        optimizer.step = types.MethodType(_mirrored_step, optimizer)  # type: ignore[method-assign]
        optimizer._phalanx_mirror = self  # type: ignore[attr-defined]

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> None:
        # Phase 1: the chunks holding a parameter with a gradient.
        self._refresh_chunks()
        todo = [i for i, c in enumerate(self._chunks) if any(p.grad is not None for p in c)]
        grads = {id(p): p.grad for c in self._chunks for p in c}
        for c in self._chunks:
            for p in c:
                p.grad = None
        try:
            load = self._queue_load(todo[0]) if todo else None
            for k, i in enumerate(todo):
                # Phase 2: this chunk's state in, the next one's read queued.
                self._install(i, load)
                load = self._queue_load(todo[k + 1]) if k + 1 < len(todo) else None
                # Phase 3: step this chunk alone, then send its state out.
                for p in self._chunks[i]:
                    p.grad = grads[id(p)]
                self._original_step()
                for p in self._chunks[i]:
                    p.grad = None
                self._evict_chunk(i)
                self.num_chunks_stepped += 1
        finally:
            # Phase 4: every gradient back where it was.
            for c in self._chunks:
                for p in c:
                    p.grad = grads[id(p)]

    def _refresh_chunks(self) -> None:
        """Consecutive parameters in the optimizer's order, about ``chunk_bytes`` of state per
        chunk; recomputed (with every state resident) when the parameters changed."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if [id(p) for c in self._chunks for p in c] == [id(p) for p in params]:
            return
        assert not self._stored, "materialize() before the optimizer's parameters change"
        self._chunks, size = [], self.chunk_bytes
        for p in params:
            if size >= self.chunk_bytes:
                self._chunks.append([])
                size = 0
            self._chunks[-1].append(p)
            size += _state_bytes_estimate(self.optimizer, p)

    def _queue_load(self, i: int) -> tuple[_Stored, Future] | None:
        stored = self._stored.pop(i, None)
        if stored is None:
            return None  # no state yet (the first step creates it) or already resident
        return stored, self.tier.get(stored.slot, tag=("optimizer", i))

    def _install(self, i: int, load: tuple[_Stored, Future] | None) -> None:
        if load is None:
            return
        stored, future = load
        loaded: Loaded = future.result()
        data = loaded.use()
        self.tier.free(stored.slot)
        for e in stored.entries:
            view = data[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)
            self.optimizer.state[e.param][e.key] = view
        self._loaded[i] = data

    def _evict_chunk(self, i: int) -> None:
        """Queue chunk ``i``'s state for writing and drop it from the optimizer. The optimizer
        updates state in place, so the buffer loaded for this step usually holds the new state
        already and is written as is; otherwise the tensors are packed into a new one."""
        entries, tensors, offset = [], [], 0
        for p in self._chunks[i]:
            for key, value in self.optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.numel() >= MIN_OFFLOAD_ELEMENTS:
                    nbytes = value.numel() * value.element_size()
                    entries.append(_Entry(p, key, value.dtype, value.shape, offset, nbytes))
                    tensors.append(value)
                    offset += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
        loaded = self._loaded.pop(i, None)
        if not entries:
            return
        blob = _pack(tensors, entries, offset, loaded)
        if len(self._writes) >= 2:  # bound what waits in memory for the tier
            self._writes.pop(0).result()
        slot = self.tier.put(blob, tag=("optimizer", i))
        self._writes.append(slot.written)
        self._stored[i] = _Stored(slot, entries)
        for e in entries:
            del self.optimizer.state[e.param][e.key]

    # -- outside the step ---------------------------------------------------------------------
    def materialize(self) -> None:
        """Every state tensor back in the optimizer (for code that reads or replaces it)."""
        for i in sorted(self._stored):
            self._install(i, self._queue_load(i))
        self._loaded.clear()  # new tensors may replace the views: pack afresh next time
        self._wait_writes()

    def evict(self) -> None:
        """Every resident state tensor out to the tier again."""
        self._refresh_chunks()
        for i in range(len(self._chunks)):
            if i not in self._stored:
                self._evict_chunk(i)
        self._wait_writes()

    @contextmanager
    def resident(self) -> Iterator[None]:
        """The whole state in the optimizer inside the block, out in the tier after it."""
        self.num_resident += 1
        self.materialize()
        try:
            yield
        finally:
            self.evict()

    def sync(self) -> None:
        """Nothing to wait for: ``step`` returns with the parameters updated."""

    # The Engine's hooks of the host mirror (memory.host_mirror): nothing to do here, the state
    # streams at the step and the gradients stay where they are.
    def listen(self, strategy: Any) -> None:
        del strategy

    def begin_step(self) -> None:
        return None

    def scale_gradients(self, factor: float) -> None:
        del factor

    def stored_bytes(self) -> int:
        """Bytes of optimizer state held in the tier now."""
        return sum(e.nbytes for s in self._stored.values() for e in s.entries)

    def _wait_writes(self) -> None:
        for future in self._writes:
            future.result()
        self._writes = []

    def close(self) -> None:
        """Bring the state back into the optimizer and give it its own ``step`` again (the
        optimizer then works without the mirror; before the tier closes). At interpreter
        exit, when Python has already stopped the tier's I/O thread, the state is left where
        it is: the process is ending."""
        try:
            self.materialize()
        except RuntimeError as e:
            if "after shutdown" not in str(e):  # concurrent.futures at interpreter exit
                raise
        if self.optimizer.__dict__.get("step") is not None:
            del self.optimizer.step  # an LR scheduler's wrapper, if any, goes with it
        del self.optimizer._phalanx_mirror  # type: ignore[attr-defined]


def _mirrored_step(optimizer: torch.optim.Optimizer, closure: Any = None) -> None:
    if closure is not None:
        raise ValueError("the host optimizer mirror steps without a closure")
    optimizer._phalanx_mirror.step()  # type: ignore[attr-defined]


def _pack(
    tensors: list[torch.Tensor], entries: list[_Entry], nbytes: int, loaded: torch.Tensor | None
) -> torch.Tensor:
    """One 1-D uint8 buffer holding ``tensors`` at their entries' offsets: ``loaded`` itself
    when they are still its views at those offsets, else a new buffer."""
    if loaded is not None and loaded.numel() == nbytes:
        base = loaded.data_ptr()
        if all(t.data_ptr() - base == e.offset for t, e in zip(tensors, entries)):
            return loaded
    blob = torch.empty(nbytes, dtype=torch.uint8, device=tensors[0].device)
    for t, e in zip(tensors, entries):
        blob[e.offset : e.offset + e.nbytes].copy_(t.reshape(-1).view(torch.uint8))
    return blob


def _state_bytes_estimate(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> int:
    """Bytes of ``p``'s state: what is stored or resident, else two tensors like ``p`` (Adam's
    worst case, before the first step created any)."""
    state = optimizer.state.get(p, {})
    resident = sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return resident if resident > p.numel() else 2 * p.numel() * p.element_size()
