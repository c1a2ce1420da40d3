"""F19: the optimizer's large state lives in the next tier and streams through memory chunk by
chunk, one (elementwise) step per chunk (docs/memory.md, ``stream``); 64-byte aligned uint8."""

from __future__ import annotations

import types
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from phalanx.memory.residency import StepMirror
from phalanx.memory.tiers import Loaded, Slot, Tier
from phalanx.slices import LazySlices

ALIGN_BYTES = 64  # every state tensor starts at a multiple of this in a chunk's buffer
MIN_OFFLOAD_ELEMENTS = 2  # smaller state (step counters) stays resident
MIN_PIECE = 1 << 12  # elements: a parameter is not cut finer (a chunk may exceed its bytes by it)


@dataclass(eq=False)
class _Piece:
    """Elements ``[start, end)`` of ``param`` (flattened): ``view`` is what the optimizer steps
    (a flat view of the parameter's data), its state is the piece's own."""

    param: torch.Tensor
    start: int
    end: int
    view: torch.Tensor


@dataclass(frozen=True)
class _Entry:
    """One offloaded state tensor: its piece, key, dtype, shape and byte range."""

    param: _Piece
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


class OptimizerMirror(StepMirror):
    """The optimizer's state in ``tier`` between steps (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, tier: Tier, chunk_bytes: int) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes: must be >= 1, got {chunk_bytes}")
        self.optimizer = optimizer
        self.tier = tier
        self.chunk_bytes = chunk_bytes
        self._chunks: list[list[_Piece]] = []  # fixed at the first eviction
        self._params: list[torch.Tensor] = []  # the optimizer's parameters the pieces cut
        self._stored: dict[int, _Stored] = {}  # chunk index -> its state in the tier
        self._loaded: dict[int, torch.Tensor] = {}  # chunk index -> buffer its state views
        self._writes: list[Future] = []
        self._read_cache: tuple[int, torch.Tensor] | None = None  # lazy_shards' last chunk
        self._discard = False  # close() drops the state (discard_state)
        self.num_chunks_stepped = 0
        self.num_resident = 0  # resident() blocks entered (checkpoints, sharded rebuilds)
        self._original_step = optimizer.step
        self._take_step()

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> None:
        # Phase 1: the pieces, and which chunks hold a gradient.
        self._read_cache = None  # the state changes: a checkpoint's read of it is stale
        self._refresh_chunks()
        todo = [i for i, c in enumerate(self._chunks) if any(x.param.grad is not None for x in c)]
        groups = self.optimizer.param_groups
        params = [g["params"] for g in groups]
        group_of = {id(p): k for k, g in enumerate(groups) for p in g["params"]}
        try:
            load = self._queue_load(todo[0]) if todo else None
            for k, i in enumerate(todo):
                # Phase 2: this chunk's state in, the next one's read queued.
                self._install(i, load)
                load = self._queue_load(todo[k + 1]) if k + 1 < len(todo) else None
                # Phase 3: step this chunk's pieces alone, then send their state out.
                for g in groups:
                    g["params"] = []
                cut = [x for x in self._chunks[i] if x.view is not x.param]
                for piece in self._chunks[i]:
                    grad = piece.param.grad
                    if grad is None:
                        continue
                    if piece.view is not piece.param:
                        piece.view.grad = grad.detach().view(-1)[piece.start : piece.end]
                    groups[group_of[id(piece.param)]]["params"].append(piece.view)
                self._original_step()
                for piece in cut:
                    piece.view.grad = None
                self._evict_chunk(i)
                self.num_chunks_stepped += 1
        finally:
            # Phase 4: every group's parameters back.
            for g, kept in zip(groups, params):
                g["params"] = kept

    def _refresh_chunks(self) -> None:
        """Pieces of about ``chunk_bytes`` of state, in the optimizer's order; recomputed (with
        every state resident) when the parameters changed."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if [id(p) for p in self._params] == [id(p) for p in params]:
            return
        assert not self._stored, "materialize() before the optimizer's parameters change"
        self._params, self._chunks, room = params, [], 0
        for p in params:
            per_element = max(1, _state_bytes_estimate(self.optimizer, p) // max(1, p.numel()))
            flat = p.detach().view(-1) if p.is_contiguous() else None
            start = 0
            while start < p.numel() or (start == 0 and p.numel() == 0):
                if room <= 0:
                    self._chunks.append([])
                    room = self.chunk_bytes
                take = p.numel() - start if flat is None else max(MIN_PIECE, room // per_element)
                end = min(p.numel(), start + take)
                view = p if flat is None or (start, end) == (0, p.numel()) else flat[start:end]
                self._chunks[-1].append(_Piece(p, start, end, view))
                room -= (end - start) * per_element
                if end == start:
                    break
                start = end
        # Optimizers that create their state at construction (Adagrad before torch 2.12) hold
        # it keyed by the whole parameter; each piece steps its own part.
        self._cut_whole_states()

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
            self.optimizer.state[e.param.view][e.key] = view
        self._loaded[i] = data

    def _evict_chunk(self, i: int) -> None:
        """Queue chunk ``i``'s state for writing and drop it from the optimizer (the loaded buffer,
        updated in place, is written as is; otherwise a new one is packed)."""
        entries, tensors, offset = [], [], 0
        for piece in self._chunks[i]:
            for key, value in self.optimizer.state.get(piece.view, {}).items():
                if torch.is_tensor(value) and value.numel() >= MIN_OFFLOAD_ELEMENTS:
                    nbytes = value.numel() * value.element_size()
                    entries.append(_Entry(piece, key, value.dtype, value.shape, offset, nbytes))
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
            del self.optimizer.state[e.param.view][e.key]

    # -- outside the step ---------------------------------------------------------------------
    def materialize(self) -> None:
        self._read_cache = None
        state = self.optimizer.state
        # A cut parameter's state is joined into tensors of its own as each chunk arrives, so
        # at most one chunk's buffer is held beside the joined state.
        joined: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for i in sorted(self._stored):
            stored, future = self._queue_load(i) or (None, None)
            assert stored is not None and future is not None
            data = future.result().use()
            self.tier.free(stored.slot)
            for e in stored.entries:
                value = data[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)
                piece = e.param
                if piece.view is piece.param:
                    state[piece.param][e.key] = value  # a view of this chunk's buffer
                    continue
                into = joined.setdefault(piece.param, {})
                if e.key not in into:
                    into[e.key] = torch.empty(
                        piece.param.numel(), dtype=e.dtype, device=data.device
                    )
                into[e.key][piece.start : piece.end].copy_(value.reshape(-1))
            del data
        self._loaded.clear()  # new tensors may replace the views: pack afresh next time
        self._wait_writes()
        for p, pieces in self._pieces_by_param().items():
            if all(x.view is p for x in pieces):
                continue  # a whole parameter: its state is keyed by it already
            small = [state.pop(x.view, {}) for x in pieces]  # counters stayed resident
            whole = {k: v.view(p.shape) for k, v in joined.pop(p, {}).items()}
            if whole or small[0]:
                state[p] = {**small[0], **whole}

    def evict(self) -> None:
        self._refresh_chunks()
        self._cut_whole_states()
        for i in range(len(self._chunks)):
            if i not in self._stored:
                self._evict_chunk(i)
        self._wait_writes()

    def _cut_whole_states(self) -> None:
        """The state of each parameter stepped in pieces, cut into its pieces' (views)."""
        state = self.optimizer.state
        for p, pieces in self._pieces_by_param().items():
            whole = state.get(p)
            if whole and not all(x.view is p for x in pieces):
                del state[p]
                for piece in pieces:
                    state[piece.view] = _cut(whole, piece)

    def _pieces_by_param(self) -> dict[torch.Tensor, list[_Piece]]:
        found: dict[torch.Tensor, list[_Piece]] = {}
        for chunk in self._chunks:
            for piece in chunk:
                found.setdefault(piece.param, []).append(piece)
        return found

    def sync(self) -> None:
        """Nothing to wait for: ``step`` returns with the parameters updated."""

    # The host mirror's hooks: nothing to do, the gradients stay where they are.
    def listen(self, strategy: Any) -> None:
        del strategy

    def begin_step(self) -> None:
        return None

    def scale_gradients(self, factor: float) -> None:
        del factor

    def lazy_shards(
        self, params: list[torch.Tensor]
    ) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]] | None:
        """The state for a checkpoint that reads the tier one piece at a time (``LazySlices``);
        None where the parameters are not ``params`` (flat shards) or state is resident."""
        index = {id(p): i for i, p in enumerate(params)}
        if any(id(p) not in index for p in self._params):
            return None
        state = self.optimizer.state
        for entry in state.values():
            if any(torch.is_tensor(v) and v.dim() > 0 for v in entry.values()):
                return None
        self._wait_writes()
        ranges: dict[tuple[int, str], list[tuple[_Piece, int, _Entry]]] = {}
        for i, stored in self._stored.items():
            for e in stored.entries:
                ranges.setdefault((index[id(e.param.param)], e.key), []).append((e.param, i, e))
        shards: dict[int, dict[str, Any]] = {}
        for p, pieces in self._pieces_by_param().items():
            small = state.get(pieces[0].view, {})
            if small:
                shards.setdefault(index[id(p)], {}).update(small)
        for (i, key), found in ranges.items():
            found.sort(key=lambda item: item[0].start)
            p, dtype = params[i], found[0][2].dtype
            spans = [(piece.start, piece.end) for piece, _, _ in found]
            load = partial(self._read_range, found)
            shards.setdefault(i, {})[key] = LazySlices(p.shape, dtype, spans, load)
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [index[id(p)] for p in g["params"] if id(p) in index],
            }
            for g in self.optimizer.param_groups
        ]
        return shards, groups

    def _read_range(
        self, found: list[tuple[_Piece, int, _Entry]], start: int, numel: int
    ) -> torch.Tensor:
        """Elements [start, start + numel) of one state tensor, read from the chunk holding
        them (the last chunk read is kept for the next range)."""
        for piece, i, e in found:
            if piece.start <= start and start + numel <= piece.end:
                cached = self._read_cache
                if cached is None or cached[0] != i:
                    stored = self._stored[i]
                    data = self.tier.get(stored.slot, tag=("checkpoint", i)).result().use()
                    cached = self._read_cache = (i, data)
                flat = cached[1][e.offset : e.offset + e.nbytes].view(e.dtype)
                return flat[start - piece.start : start - piece.start + numel].clone()
        raise ValueError(f"optimizer mirror: no stored piece holds elements {start}..")

    def stored_bytes(self) -> int:
        """Bytes of optimizer state held in the tier now."""
        return sum(e.nbytes for s in self._stored.values() for e in s.entries)

    def _wait_writes(self) -> None:
        for future in self._writes:
            future.result()
        self._writes = []

    def close(self) -> None:
        """The state back in the optimizer (unless ``discard_state``), its own ``step`` again;
        at interpreter exit (the tier's thread stopped) the state is left where it is."""
        if self._discard:
            self._stored.clear()
            self._wait_writes()
            self.optimizer.state.clear()
            self.optimizer.step = types.MethodType(_discarded_step, self.optimizer)  # type: ignore[method-assign]
            del self.optimizer._phalanx_mirror  # type: ignore[attr-defined]
            return
        try:
            self.materialize()
        except RuntimeError as e:
            if "after shutdown" not in str(e):  # concurrent.futures at interpreter exit
                raise
        self._release_step()

    def discard_state(self) -> None:
        """``close`` drops the state instead (after the last checkpoint, bringing gigabytes
        back only to exit would be the process's peak); the optimizer then refuses to step."""
        self._discard = True


def _discarded_step(optimizer: torch.optim.Optimizer, closure: Any = None) -> None:
    raise RuntimeError(
        "this optimizer's state was dropped when its run closed (OptimizerMirror."
        "discard_state); load a checkpoint into a new Engine to train on"
    )


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


def _cut(whole: dict[str, Any], piece: _Piece) -> dict[str, Any]:
    """A piece's state from its parameter's whole state (the inverse of ``_join``)."""
    numel = piece.param.numel()
    cut: dict[str, Any] = {}
    for key, value in whole.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel:
            cut[key] = value.detach().reshape(-1)[piece.start : piece.end]  # a view: packed once
        else:
            cut[key] = value.clone() if torch.is_tensor(value) else value
    return cut


def _state_bytes_estimate(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> int:
    """Bytes of ``p``'s state: what is stored or resident, else two tensors like ``p`` (Adam's
    worst case, before the first step created any)."""
    state = optimizer.state.get(p, {})
    resident = sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return resident if resident > p.numel() else 2 * p.numel() * p.element_size()
