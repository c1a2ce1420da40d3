"""Activation offload with prefetch (F18), on torch's hooks: a layer's saved tensors go to the
tier after its forward and come back one layer ahead in backward (docs/memory.md)."""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from phalanx.errors import ConfigError
from phalanx.memory.tiers import Slot, Tier

MIN_BYTES = 1 << 20  # smaller saved tensors stay where they are: not worth a transfer
MAX_INFLIGHT_BYTES = 256 << 20  # forward waits when more than this is still being written


@dataclass
class OffloadStats:
    """One step's offload (reset when ``step()`` is entered)."""

    tensors: int = 0  # storages moved to the tier
    deduped: int = 0  # saves that found their storage already moved (saved twice)
    kept: int = 0  # saves of offloaded layers left in place (small, parameters, other device)
    bytes_written: int = 0  # bytes sent to the tier
    bytes_read: int = 0  # bytes fetched back
    prefetched: int = 0  # reads started ahead of need (layer i-1 when layer i's backward starts)
    demand_reads: int = 0  # reads started by an unpack that found nothing prefetched
    forward_wait_s: float = 0.0  # forward blocked on the in-flight limit
    backward_wait_s: float = 0.0  # backward blocked in unpack, waiting for reads
    io_s: float = 0.0  # the tier's time moving bytes during the step (its I/O thread)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class _Record:
    """One storage in the tier. Lives as long as a saved handle refers to it (the autograd
    graph holds the handles), then gives its slot back to the tier."""

    __slots__ = ("tier", "slot", "nbytes", "layer", "unpacks_left", "read", "stale", "__weakref__")

    def __init__(self, tier: Tier, slot: Slot, nbytes: int, layer: int) -> None:
        self.tier, self.slot, self.nbytes, self.layer = tier, slot, nbytes, layer
        self.unpacks_left = 0  # saved handles not yet unpacked in this backward
        self.read: Future | None = None  # the read in flight or done; dropped after last unpack
        self.stale = False  # the source changed while it was being written

    def __del__(self) -> None:
        # the graph let go of the last handle; the next step reuses the space
        try:
            self.tier.free(self.slot)
        except Exception:  # noqa: BLE001 - interpreter shutdown; the tier is going away anyway
            pass


class _Saved:
    """What autograd keeps instead of a moved tensor: the record and the view to rebuild."""

    __slots__ = ("record", "dtype", "size", "stride", "offset", "layer")

    def __init__(self, record: _Record, tensor: torch.Tensor, layer: int) -> None:
        self.record, self.layer = record, layer
        self.dtype = tensor.dtype
        self.size, self.stride = tuple(tensor.size()), tuple(tensor.stride())
        self.offset = tensor.storage_offset()  # elements of ``dtype``


def _in_backward() -> bool:
    """Whether this thread runs a backward (e.g. a reentrant checkpoint's recompute)."""
    graph_task = getattr(torch._C, "_current_graph_task_id", None)
    return graph_task is not None and graph_task() != -1


class ActivationOffloader:
    """The ``offload`` layers' saved tensors to ``tier`` and back (bit-identical); beyond
    ``max_inflight_bytes`` queued, forward waits; ``step()`` goes around forward + backward."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        offload: Iterable[int],
        tier: Tier,
        min_bytes: int = MIN_BYTES,
        *,
        max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
        lookahead: int = 1,
        prefetch_bytes: int | None = None,
    ) -> None:
        self.layers = list(layers)
        self.offload = set(offload)
        bad = sorted(i for i in self.offload if not 0 <= i < len(self.layers))
        if bad:
            raise ConfigError(f"offload: layer {bad[0]} out of range (model has {len(layers)})")
        if min_bytes < 0 or max_inflight_bytes <= 0 or lookahead < 1:
            raise ConfigError("offload: min_bytes >= 0, max_inflight_bytes > 0, lookahead >= 1")
        if prefetch_bytes is not None and prefetch_bytes < 0:
            raise ConfigError(f"offload: prefetch_bytes must be >= 0, got {prefetch_bytes}")
        self.tier = tier
        self.min_bytes = min_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.lookahead = lookahead
        # bytes of a layer read ahead of its backward (None: all of them); the rest is read
        # when its backward starts, so a tighter budget fits at the cost of exposed reads
        self.prefetch_bytes = prefetch_bytes
        self.stats = OffloadStats()
        self._hooks: list[Any] = []
        self._stack: list[int] = []  # layers whose forward is running (innermost last)
        self._param_storages: set[int] = set()
        # storage data_ptr -> (tensor it was first saved from, record, version then); the tensor
        # reference is weak: once it is gone the address may belong to another storage.
        self._seen: dict[int, tuple[weakref.ref, weakref.ref, int]] = {}
        self._by_layer: list[list[weakref.ref[_Record]]] = [[] for _ in self.layers]
        self._writes: deque[tuple[Future, int]] = deque()  # in flight, oldest first
        self._io_at_start = 0.0
        self._closed = False

    # -- the context manager -------------------------------------------------------------------
    @contextmanager
    def step(self) -> Iterator[OffloadStats]:
        """Offload during the forward and backward run inside; yields this step's stats."""
        if self._closed:
            raise RuntimeError("ActivationOffloader is closed")
        if self._hooks:
            raise RuntimeError("ActivationOffloader.step() is already active")
        self.stats = OffloadStats()
        self._io_at_start = self.tier.io_seconds
        self._by_layer = [[ref for ref in refs if ref() is not None] for refs in self._by_layer]
        self._param_storages = {
            _local(t).untyped_storage().data_ptr()
            for layer in self.layers
            for t in (*layer.parameters(), *layer.buffers())
        }
        for index, layer in enumerate(self.layers):
            self._hooks.append(layer.register_forward_pre_hook(partial(self._enter, index)))
            self._hooks.append(layer.register_forward_hook(partial(self._exit, index)))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self.stats
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            self._stack.clear()
            self._seen.clear()
            self.stats.io_s = self.tier.io_seconds - self._io_at_start

    def live_records(self) -> int:
        """Storages still held in the tier for a graph not yet freed (0 after a backward)."""
        return len({id(r) for refs in self._by_layer for ref in refs if (r := ref()) is not None})

    def close(self) -> None:
        """Remove the hooks, stop the tier's thread and close it (its file, its buffers)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._closed = True
        self.tier.close()

    def __enter__(self) -> ActivationOffloader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- which layer runs ----------------------------------------------------------------------
    def _enter(self, index: int, module: nn.Module, args: Any) -> None:
        self._stack.append(index)

    def _exit(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack and self._stack[-1] == index:
            self._stack.pop()
        if torch.is_grad_enabled() and not _in_backward():
            self._watch_backward(index, output)

    def _watch_backward(self, index: int, output: Any) -> None:
        """Pre-hook on the node(s) that produced the layer's output: its backward starts there."""
        nodes = {id(t.grad_fn): t.grad_fn for t in _tensors(output) if t.grad_fn is not None}
        for node in nodes.values():
            node.register_prehook(partial(self._backward_starts, index))

    # -- forward -------------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> Any:
        layer = self._stack[-1] if self._stack else None
        if layer is None or layer not in self.offload:
            return tensor
        if not self._movable(tensor):
            self.stats.kept += 1
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        record: _Record | None = None
        seen = self._seen.get(key)
        if seen is not None:
            source, ref, version = seen
            alive = source()  # alive: its storage, hence this address, is still the same
            if alive is not None and alive.untyped_storage().data_ptr() == key:
                record = ref() if version == tensor._version else None
        if record is None:
            record = self._move(tensor, storage, layer)
            self._seen[key] = (weakref.ref(tensor), weakref.ref(record), tensor._version)
        else:
            self.stats.deduped += 1
        record.unpacks_left += 1
        refs = self._by_layer[layer]
        if not refs or refs[-1]() is not record:
            refs.append(weakref.ref(record))
        return _Saved(record, tensor, layer)

    def _movable(self, tensor: torch.Tensor) -> bool:
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
            return False  # parameters (nn.Parameter), subclasses, sparse
        if tensor.device != self.tier.device or _in_backward():
            return False  # another device; or a reentrant checkpoint recomputing in backward
        if tensor.is_leaf and tensor.requires_grad or tensor.is_conj() or tensor.is_neg():
            return False
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        return 0 < nbytes >= self.min_bytes and storage.data_ptr() not in self._param_storages

    def _move(self, tensor: torch.Tensor, storage: Any, layer: int) -> _Record:
        nbytes = storage.nbytes()
        self._throttle(nbytes)
        data = _storage_bytes(tensor, nbytes)
        version = data._version
        slot = self.tier.put(data, layer)
        record = _Record(self.tier, slot, nbytes, layer)
        self._writes.append((slot.written, nbytes))
        self.stats.tensors += 1
        self.stats.bytes_written += nbytes
        # Weak references only: the callback stays on the future, which the record holds. The
        # tier holds ``data`` until after its callbacks ran, so the check sees it alive.
        slot.written.add_done_callback(
            partial(_check_source, weakref.ref(data), version, weakref.ref(record))
        )
        del data  # from here only the tier holds it, until the write completed
        return record

    def _throttle(self, nbytes: int) -> None:
        """Wait for the oldest writes while more than ``max_inflight_bytes`` would be queued."""
        writes = self._writes
        while writes and writes[0][0].done():
            writes.popleft()
        inflight = sum(n for future, n in writes if not future.done())
        if not writes or inflight + nbytes <= self.max_inflight_bytes:
            return
        start = time.perf_counter()
        while writes and inflight + nbytes > self.max_inflight_bytes:
            future, n = writes.popleft()
            wait_futures([future])
            inflight -= n
        self.stats.forward_wait_s += time.perf_counter() - start

    # -- backward ------------------------------------------------------------------------------
    def _backward_starts(self, layer: int, grad_outputs: Any) -> None:
        """Layer ``layer``'s backward starts: read what it and its predecessors need."""
        self._prefetch(layer, ahead=False)  # the first layer backward reaches: not yet asked
        for previous in range(layer - 1, max(-1, layer - 1 - self.lookahead), -1):
            self._prefetch(previous, ahead=True)

    def _prefetch(self, layer: int, ahead: bool) -> None:
        """Queue the reads of ``layer``'s records, the last saved first (backward needs them
        first); ahead of its backward at most ``prefetch_bytes`` of them."""
        if layer not in self.offload:
            return
        live = [ref for ref in self._by_layer[layer] if ref() is not None]
        self._by_layer[layer] = live
        records = [r for ref in reversed(live) if (r := ref()) is not None]
        cap = self.prefetch_bytes if ahead else None
        inflight = sum(r.nbytes for r in records if r.read is not None)
        for record in records:
            if record.read is not None or record.unpacks_left <= 0:
                continue
            if cap is not None and inflight + record.nbytes > cap:
                break
            self._request(record)
            inflight += record.nbytes
            if ahead:
                self.stats.prefetched += 1

    def _request(self, record: _Record) -> None:
        record.read = self.tier.get(record.slot, record.layer)
        self.stats.bytes_read += record.nbytes

    def _unpack(self, saved: _Saved | torch.Tensor) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):  # kept in place by _pack
            return saved
        record = saved.record
        if record.read is None:  # nothing prefetched (a layer without a backward start seen)
            self.stats.demand_reads += 1
            self._request(record)
            self._backward_starts(saved.layer, None)
        assert record.read is not None  # set by _request
        start = time.perf_counter()
        try:
            loaded = record.read.result()
        finally:
            self.stats.backward_wait_s += time.perf_counter() - start
            written = record.slot.written  # on CPU done by now: the read was queued after it
            if written.done() and written.exception() is not None:  # e.g. the disk is full
                error = written.exception()
                raise RuntimeError(f"offload of layer {saved.layer} failed: {error}") from error
        if record.stale:
            raise RuntimeError(
                f"a tensor saved by layer {saved.layer} was modified in place while it was "
                "being offloaded; backward cannot use it"
            )
        data = loaded.use()  # 1-D uint8, the storage's bytes, on the original device
        record.unpacks_left -= 1
        if record.unpacks_left <= 0:
            record.read = None  # the bytes now live as long as the node that unpacked them
        if data.storage_offset() % saved.dtype.itemsize:  # misaligned for the dtype: rare
            data = data.clone()
        typed = data.view(saved.dtype)
        return typed.as_strided(saved.size, saved.stride, typed.storage_offset() + saved.offset)


def _storage_bytes(tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The storage of ``tensor`` as flat uint8, sharing its version counter where possible (an
    in-place change during the write shows)."""
    itemsize = tensor.element_size()
    if nbytes % itemsize == 0:
        flat = tensor.detach().as_strided((nbytes // itemsize,), (1,), 0)
        return flat.view(torch.uint8)
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)


def _check_source(source: weakref.ref, version: int, record: weakref.ref, future: Future) -> None:
    """Write completed (I/O thread): the bytes must not have changed since they were saved."""
    data, rec = source(), record()
    if data is not None and rec is not None and data._version != version:
        rec.stale = True


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded parameter (fsdp's DTensors), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
