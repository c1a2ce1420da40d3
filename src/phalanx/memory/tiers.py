"""Memory tiers (F18): ``pinned_host`` (CUDA), ``spill_file`` (CPU) move 1-D uint8 buffers out
and back asynchronously (docs/memory.md); ``tier.log`` lets tests check *when* without timing."""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from statistics import median
from typing import Any, NamedTuple

import torch

from phalanx.errors import ConfigError
from phalanx.fields import option, require, require_choice
from phalanx.registry import Registry

ALIGN = 4096  # bytes: O_DIRECT needs offsets, lengths and buffer addresses aligned to the block
LOG_LENGTH = 100_000  # requests kept in ``Tier.log``
PINNED_ROUND = 1 << 16  # pinned buffers are pooled by size rounded up to this many bytes
DIRECT_IO = ("auto", "on", "off")


def round_up(nbytes: int, align: int = ALIGN) -> int:
    return -(-nbytes // align) * align


class Request(NamedTuple):
    """One submitted transfer: ``op`` is "write" or "read"; ``tag`` is the caller's label."""

    op: str
    tag: Any
    offset: int
    nbytes: int


@dataclass(eq=False)
class Slot:
    """Space in a tier holding ``nbytes`` (``capacity`` reserved). ``written`` resolves (to the
    seconds the write took) once the bytes are in the tier and the source has been let go."""

    offset: int
    nbytes: int
    capacity: int
    written: Future
    host: torch.Tensor | None = None  # pinned_host: the page-locked buffer (uint8, capacity)
    busy: int = 0  # requests in flight on this slot (guarded by the tier's lock)
    release: bool = False  # freed while busy: reclaim when the last request completes


@dataclass(eq=False)
class Loaded:
    """Bytes back: ``data`` 1-D uint8 on the tier's device, on CUDA ready at ``event``."""

    data: torch.Tensor
    event: Any = None

    def use(self) -> torch.Tensor:
        if self.event is not None:
            stream = torch.cuda.current_stream(self.data.device)
            stream.wait_event(self.event)
            self.data.record_stream(stream)  # the allocator must not hand it back to our stream
        return self.data

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class Tier:
    """Base of the tiers: request log, byte/second counters, deferred reclaiming of busy slots."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.log: deque[Request] = deque(maxlen=LOG_LENGTH)
        self.bytes_written = 0
        self.bytes_read = 0
        self.io_seconds = 0.0  # time spent moving bytes (the I/O thread's busy time)
        self.overhead_bytes = 0  # device memory the tier itself holds (its staging buffers)
        self._lock = threading.Lock()
        self._closed = False

    # -- the protocol --------------------------------------------------------------------------
    def put(self, data: torch.Tensor, tag: Any = None) -> Slot:
        """Start moving ``data`` (1-D contiguous uint8 on ``device``) into the tier. The tier
        holds ``data`` only until the write completed; the caller must not modify it until then."""
        raise NotImplementedError

    def get(self, slot: Slot, tag: Any = None) -> Future:
        """Start moving a slot's bytes back; the future's result is a ``Loaded``."""
        raise NotImplementedError

    def free(self, slot: Slot) -> None:
        """The slot's space may be reused (once the requests in flight on it have completed)."""
        with self._lock:
            if slot.busy:
                slot.release = True
                return
        self._reclaim(slot)

    def close(self) -> None:
        self._closed = True

    # -- shared machinery ----------------------------------------------------------------------
    def _reclaim(self, slot: Slot) -> None:
        raise NotImplementedError

    def _begin(self, slot: Slot, op: str, tag: Any) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        self.log.append(Request(op, tag, slot.offset, slot.nbytes))
        with self._lock:
            slot.busy += 1

    def _end(self, slot: Slot, op: str, seconds: float) -> None:
        with self._lock:
            slot.busy -= 1
            reclaim = slot.busy == 0 and slot.release
            self.io_seconds += seconds
            if op == "write":
                self.bytes_written += slot.nbytes
            else:
                self.bytes_read += slot.nbytes
        if reclaim:
            self._reclaim(slot)

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


TIERS: Registry[Tier] = Registry("memory tier")
AUTO_TIER = {"cuda": "pinned_host", "cpu": "spill_file"}  # device type -> tier for name="auto"


@dataclass
class TierConfig:
    """Where offloaded tensors go."""

    name: str = option("auto", "tier: pinned_host (CUDA), spill_file (CPU) or auto (by device)")
    directory: str = option("", "spill_file: directory on local disk ('' = the temp directory)")
    direct_io: str = option("auto", "spill_file: O_DIRECT on, off (page cache + fadvise) or auto")
    staging_mb: float = option(8.0, "spill_file: aligned staging buffer for direct writes, MiB")

    def __post_init__(self) -> None:
        TIERS.require_known(self.name, "name", "tier", extra=["auto"])
        require_choice(self.direct_io, "direct_io", DIRECT_IO)
        require(self.staging_mb > 0, "staging_mb", f"must be > 0, got {self.staging_mb}")


def make_tier(config: TierConfig, device: torch.device) -> Tier:
    """The tier ``config`` names, for tensors on ``device``."""
    name = AUTO_TIER.get(device.type, "spill_file") if config.name == "auto" else config.name
    return TIERS.get(name)(device, config)


# -- CPU: the spill file -----------------------------------------------------------------------
class Extents:
    """First-fit allocator of aligned ranges in a file that only grows; freed ranges coalesce,
    so a step asking for the same sizes gets the same offsets and the file stops growing."""

    def __init__(self, align: int = ALIGN) -> None:
        self.align = align
        self.end = 0  # bytes of file in use or free below this
        self._free: list[tuple[int, int]] = []  # (offset, length), sorted by offset

    def alloc(self, nbytes: int) -> tuple[int, int]:
        """(offset, capacity) of a free range of at least ``nbytes``."""
        need = round_up(max(nbytes, 1), self.align)
        for k, (offset, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[k]
                else:
                    self._free[k] = (offset + need, length - need)
                return offset, need
        if self._free and sum(self._free[-1]) == self.end:  # the free tail grows into new space
            offset, _ = self._free.pop()
        else:
            offset = self.end
        self.end = offset + need
        return offset, need

    def release(self, offset: int, length: int) -> None:
        free = self._free
        k = 0
        while k < len(free) and free[k][0] < offset:
            k += 1
        free.insert(k, (offset, length))
        if k + 1 < len(free) and offset + length == free[k + 1][0]:  # merge the next range
            free[k] = (offset, length + free[k + 1][1])
            del free[k + 1]
        if k > 0 and sum(free[k - 1]) == free[k][0]:  # merge into the previous range
            free[k - 1] = (free[k - 1][0], free[k - 1][1] + free[k][1])
            del free[k]

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self._free)


def _open_spill_file(directory: str) -> int:
    """An fd to a file with no name in ``directory``: gone on close, exit, crash and SIGKILL."""
    if not os.path.isdir(directory):
        raise ConfigError(f"spill directory {directory!r}: not a directory")
    flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
    if hasattr(os, "O_TMPFILE"):  # Linux: the file never has a name, not even for a moment
        try:
            return os.open(directory, flags | os.O_TMPFILE, 0o600)
        except OSError:  # a file system without O_TMPFILE: the unlinked named file below
            pass
    fd, path = tempfile.mkstemp(prefix="phalanx-spill-", dir=directory)
    os.unlink(path)  # right away: the open fd keeps the data, the directory forgets the name
    return fd


def _set_direct(fd: int, on: bool) -> None:
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    flags = flags | os.O_DIRECT if on else flags & ~os.O_DIRECT
    fcntl.fcntl(fd, fcntl.F_SETFL, flags)


def _pread_into(fd: int, buffer: memoryview, offset: int) -> None:
    done = 0
    while done < len(buffer):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [buffer[done:]], offset + done)
        else:  # no preadv (macOS < 11): read, then copy
            chunk = os.pread(fd, len(buffer) - done, offset + done)
            n = len(chunk)
            buffer[done : done + n] = chunk
        if n <= 0:
            raise OSError(f"spill file: short read at {offset + done}")
        done += n


def _pwrite_all(fd: int, buffer: memoryview, offset: int) -> None:
    done = 0
    while done < len(buffer):
        done += os.pwrite(fd, buffer[done:], offset + done)


def _drop_cache(fd: int, offset: int, nbytes: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def _bytes_view(data: torch.Tensor) -> memoryview:
    """A memoryview over a CPU uint8 tensor's memory (no copy)."""
    # numpy's stubs give ndarray __buffer__ only for Python >= 3.12 (it has the buffer protocol)
    return memoryview(data.numpy()).cast("B")  # type: ignore[arg-type]


class SpillFileTier(Tier):
    """Host memory <-> one unnamed spill file per process on local disk (gone however the
    process ends). One I/O thread serves requests in order, so a read sees its slot's write;
    without direct I/O, ``fdatasync`` + ``POSIX_FADV_DONTNEED`` keep pages out of the cache."""

    def __init__(
        self,
        device: torch.device | None = None,
        *,
        directory: str | os.PathLike | None = None,
        direct_io: str = "auto",
        staging_bytes: int = 8 << 20,
    ) -> None:
        device = torch.device("cpu") if device is None else torch.device(device)
        if device.type != "cpu":
            raise ConfigError(f"tier spill_file: holds CPU tensors, got a {device.type} device")
        require_choice(direct_io, "direct_io", DIRECT_IO)
        super().__init__(device)
        self.directory = str(directory) if directory else tempfile.gettempdir()
        self.fd = _open_spill_file(self.directory)
        self.extents = Extents()
        # mmap: page-aligned, as O_DIRECT wants; reused by every direct write.
        self._staging = mmap.mmap(-1, 2 * round_up(max(staging_bytes // 2, ALIGN)))
        self._staging_view = memoryview(self._staging)
        self._staging_tensor = torch.frombuffer(self._staging, dtype=torch.uint8)
        self.overhead_bytes = len(self._staging)
        self.direct = direct_io != "off" and self._try_direct()
        if direct_io == "on" and not self.direct:
            self._release_buffers()
            os.close(self.fd)
            raise ConfigError(f"spill directory {self.directory!r}: O_DIRECT is not supported")
        if not self.direct and hasattr(os, "posix_fadvise"):
            # No readahead: it would cache pages beyond the extent read, which stay resident.
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="phalanx-spill")
        # Only the I/O thread submits here, one chunk at a time: requests stay in order.
        self._disk = ThreadPoolExecutor(max_workers=1, thread_name_prefix="phalanx-spill-disk")

    def _try_direct(self) -> bool:
        """Whether O_DIRECT works here: set it and write and read one aligned block."""
        if not hasattr(os, "O_DIRECT"):
            return False
        try:
            _set_direct(self.fd, True)
            block = self._staging_view[:ALIGN]
            _pwrite_all(self.fd, block, 0)
            _pread_into(self.fd, block, 0)
            os.ftruncate(self.fd, 0)
            return True
        except OSError:
            try:
                _set_direct(self.fd, False)
                os.ftruncate(self.fd, 0)
            except OSError:
                pass
            return False

    def file_size(self) -> int:
        return os.fstat(self.fd).st_size

    def put(self, data: torch.Tensor, tag: Any = None) -> Slot:
        assert data.dtype == torch.uint8 and data.dim() == 1 and data.is_contiguous()
        nbytes = data.numel()
        with self._lock:
            offset, capacity = self.extents.alloc(nbytes)
        slot = Slot(offset, nbytes, capacity, Future())
        self._begin(slot, "write", tag)
        slot.written = self._io.submit(self._write, slot, data)
        return slot

    def _write(self, slot: Slot, data: torch.Tensor) -> float:
        start = time.perf_counter()
        try:
            if self.direct:
                self._write_direct(slot, data)
            else:
                _pwrite_all(self.fd, _bytes_view(data), slot.offset)
                getattr(os, "fdatasync", os.fsync)(self.fd)  # dirty pages cannot be dropped
                _drop_cache(self.fd, slot.offset, slot.capacity)  # clean pages leave memory
        finally:
            seconds = time.perf_counter() - start
            self._end(slot, "write", seconds)
        return seconds

    def _write_direct(self, slot: Slot, data: torch.Tensor) -> None:
        """Double-buffered: this thread copies the next chunk into one half of the staging
        buffer while the disk thread writes the other half out (both release the GIL)."""
        half = len(self._staging) // 2
        pending: list[Future | None] = [None, None]
        try:
            for k, pos in enumerate(range(0, slot.nbytes, half)):
                lo, n = k % 2 * half, min(half, slot.nbytes - pos)
                previous = pending[k % 2]
                if previous is not None:
                    previous.result()  # that half has been written out: reuse it
                self._staging_tensor[lo : lo + n].copy_(data[pos : pos + n])
                block = self._staging_view[lo : lo + round_up(n)]
                pending[k % 2] = self._disk.submit(_pwrite_all, self.fd, block, slot.offset + pos)
        finally:
            for future in pending:
                if future is not None:
                    future.result()

    def get(self, slot: Slot, tag: Any = None) -> Future:
        self._begin(slot, "read", tag)
        try:
            return self._io.submit(self._read, slot)
        except RuntimeError:  # executor shut down
            self._end(slot, "read", 0.0)
            raise

    def _read(self, slot: Slot) -> Loaded:
        start = time.perf_counter()
        try:
            if self.direct:
                raw = torch.empty(slot.capacity + ALIGN, dtype=torch.uint8)
                skip = -raw.data_ptr() % ALIGN
                buffer = raw[skip : skip + slot.capacity]
                _pread_into(self.fd, _bytes_view(buffer), slot.offset)
                out = buffer[: slot.nbytes]
            else:
                out = torch.empty(slot.nbytes, dtype=torch.uint8)
                _pread_into(self.fd, _bytes_view(out), slot.offset)
                _drop_cache(self.fd, slot.offset, slot.capacity)
        finally:
            self._end(slot, "read", time.perf_counter() - start)
        return Loaded(out)

    def _reclaim(self, slot: Slot) -> None:
        with self._lock:
            self.extents.release(slot.offset, slot.capacity)

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._io.shutdown(wait=True)
        self._disk.shutdown(wait=True)
        self._release_buffers()
        os.close(self.fd)

    def _release_buffers(self) -> None:
        del self._staging_tensor  # the exported pointers must go before the mmap can close
        try:
            self._staging_view.release()
            self._staging.close()
        except BufferError:  # a view still exported (interpreter exit mid-write): the mapping
            pass  # goes with its last reference


# -- CUDA: pinned host memory ------------------------------------------------------------------
class PinnedHostTier(Tier):
    """Device memory <-> page-locked host buffers pooled by size, copied on a side stream
    (shared by reads and writes, so a read follows its write). A completion thread lets go of
    the device tensor after its copy's event; ``Loaded.use()`` orders the consumer's stream."""

    def __init__(self, device: torch.device | None = None) -> None:
        device = torch.device("cuda") if device is None else torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ConfigError(f"tier pinned_host: needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device)
        self.stream = torch.cuda.Stream(device)
        self._pool: dict[int, list[torch.Tensor]] = {}
        self._done = ThreadPoolExecutor(max_workers=1, thread_name_prefix="phalanx-pinned")

    def _take(self, capacity: int) -> torch.Tensor:
        with self._lock:
            free = self._pool.get(capacity)
            if free:
                return free.pop()
        return torch.empty(capacity, dtype=torch.uint8, pin_memory=True)

    def put(self, data: torch.Tensor, tag: Any = None) -> Slot:
        assert data.dtype == torch.uint8 and data.dim() == 1 and data.device == self.device
        nbytes = data.numel()
        capacity = round_up(max(nbytes, 1), PINNED_ROUND)
        host = self._take(capacity)
        slot = Slot(-1, nbytes, capacity, Future(), host=host)
        self._begin(slot, "write", tag)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        start, end = _timing_events()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            start.record(self.stream)
            host[:nbytes].copy_(data, non_blocking=True)
            end.record(self.stream)
        slot.written = self._done.submit(self._finish, slot, "write", start, end, data)
        return slot

    def _finish(self, slot: Slot, op: str, start: Any, end: Any, data: Any = None) -> float:
        """Completion thread: wait for the copy; ``data`` (the source) is dropped on return."""
        seconds = 0.0
        try:
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        finally:
            self._end(slot, op, seconds)
        return seconds

    def get(self, slot: Slot, tag: Any = None) -> Future:
        assert slot.host is not None
        self._begin(slot, "read", tag)
        start, end = _timing_events()
        with torch.cuda.stream(self.stream):
            # Allocated on the side stream; Loaded.use() records the consumer's stream on it.
            out = torch.empty(slot.nbytes, dtype=torch.uint8, device=self.device)
            start.record(self.stream)
            out.copy_(slot.host[: slot.nbytes], non_blocking=True)
            end.record(self.stream)
        self._done.submit(self._finish, slot, "read", start, end)  # timing and busy count only
        future: Future = Future()
        future.set_result(Loaded(out, end))  # the host need not wait: streams order the rest
        return future

    def _reclaim(self, slot: Slot) -> None:
        # Safe on the host right away: any later copy into this buffer is queued on the same
        # side stream, after the copies that used it.
        assert slot.host is not None  # set by put(), cleared only here, once per slot
        with self._lock:
            self._pool.setdefault(slot.capacity, []).append(slot.host)
        slot.host = None

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._done.shutdown(wait=True)
        self._pool.clear()


def _timing_events() -> tuple[Any, Any]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


@TIERS.register("spill_file")
def _spill_file(device: torch.device, config: TierConfig) -> Tier:
    return SpillFileTier(
        device,
        directory=config.directory or None,
        direct_io=config.direct_io,
        staging_bytes=int(config.staging_mb * (1 << 20)),
    )


@TIERS.register("pinned_host")
def _pinned_host(device: torch.device, config: TierConfig) -> Tier:
    return PinnedHostTier(device)


def measure_bandwidth(tier: Tier, nbytes: int, repeats: int = 3) -> tuple[float, float]:
    """(write, read) bytes per second of ``tier`` for one ``nbytes`` transfer: the median of
    ``repeats`` timed round trips after a warm-up, for the planner's cost model."""
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=tier.device)
    cuda = tier.device.type == "cuda"
    writes, reads = [], []
    for round_ in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(tier.device)
        start = time.perf_counter()
        slot = tier.put(data, "bandwidth")
        slot.written.result()
        wrote = time.perf_counter() - start
        start = time.perf_counter()
        loaded = tier.get(slot, "bandwidth").result()
        loaded.synchronize()
        read = time.perf_counter() - start
        del loaded
        tier.free(slot)
        if round_:  # round 0 is the warm-up
            writes.append(wrote)
            reads.append(read)
    return nbytes / median(writes), nbytes / median(reads)
