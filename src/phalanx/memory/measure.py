"""Peak memory, counted honestly: RSS (and the cgroup's), the CUDA allocator's peak, the CPU
allocator's over a block; ``StepPeak`` is what a budget is held to; glibc's thresholds in
docs/memory.md."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from phalanx.memory import host_cache

MMAP_THRESHOLD = 1 << 16  # bytes: blocks above this get their own mapping (freed to the kernel)
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_SMAPS = Path("/proc/self/smaps")
_CGROUP_PEAK = Path("/sys/fs/cgroup/memory.peak")
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
logger = logging.getLogger("phalanx")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, where it has glibc's ``mallopt`` and ``malloc_trim`` (else None)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def malloc_settable() -> bool:
    """Whether ``set_malloc`` and ``trim`` act here (glibc)."""
    return _libc() is not None


def set_malloc(mmap_threshold: int, trim_threshold: int) -> bool:
    """glibc's fixed mmap threshold and trim threshold; whether both took (not without glibc)."""
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    return bool(libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1 and ok)


def release_freed_memory() -> bool:
    """From now on, freed host tensors of ``MMAP_THRESHOLD`` and more go back to the kernel (a
    user's ``MALLOC_MMAP_THRESHOLD_`` is left alone); whether the setting is in force."""
    huge_pages_for_large_tensors()  # in force only where the process asked early enough
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return True
    return set_malloc(MMAP_THRESHOLD, 2 * MMAP_THRESHOLD)


HUGE_PAGE = 2 << 20  # bytes: the kernel's transparent huge page on x86-64 and arm64
_THP_ENV = "THP_MEM_ALLOC_ENABLE"  # torch CPU allocator (c10 alloc_cpu): read at first 2 MiB


def huge_pages_for_large_tensors() -> bool:
    """Back CPU tensors of 2 MiB and more with transparent huge pages; whether it is in force."""
    if not _SMAPS.is_file():
        return False
    os.environ.setdefault(_THP_ENV, "1")
    probe = torch.empty(HUGE_PAGE, dtype=torch.uint8)
    return "hg" in _mapping_flags(probe.data_ptr())


def _mapping_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in _SMAPS.read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


REUSE_MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks under it come from the heap
REUSE_TRIM_THRESHOLD = 64 << 20  # free heap above this goes back to the kernel


def reuse_freed_memory() -> bool:
    """Keep freed host tensors up to 32 MiB in the heap (a user's setting is left alone);
    whether it is in force."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    return set_malloc(REUSE_MMAP_THRESHOLD, REUSE_TRIM_THRESHOLD)


def trim() -> None:
    """Hand freed host memory back to the kernel: the host cache's blocks
    (memory/host_cache.py) and the heap's free pages (glibc ``malloc_trim``)."""
    host_cache.empty()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


class StepPeak:
    """The high-water mark since construction above what was held then: CUDA's allocator, or
    VmHWM above VmRSS (reset where Linux allows, else since the process began: over-counts)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.start_bytes = current_bytes(device)
        self.exact = reset_peak(device)
        self._resets = len(_RESETS)  # marks cleared later (a profile's) still count

    def peak_bytes(self) -> int:
        """The high-water mark so far, above the start (0 where it cannot be read)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        high = max([peak_bytes(self.device), *_RESETS[self._resets :]])
        return max(0, high - self.start_bytes)


def allocator_env() -> dict[str, str]:
    """Environment for a measuring process: large blocks are mmapped, so frees show in RSS."""
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}


_RESETS: list[int] = []  # the high-water mark each reset_peak cleared, in order (StepPeak's)


def reset_peak(device: torch.device | None = None) -> bool:
    """Start a new peak; returns whether the host peak could be reset (Linux only). The mark
    it clears is kept, so a ``StepPeak`` started before still sees it."""
    if device is not None and device.type == "cuda":
        _RESETS.append(int(torch.cuda.max_memory_allocated(device)))
        torch.cuda.reset_peak_memory_stats(device)
        return True
    high = _status_bytes("VmHWM")
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    _RESETS.append(high)
    return True


def current_bytes(device: torch.device) -> int:
    """What the process holds now: CUDA's allocated bytes on a GPU, else its resident set."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return current_rss_bytes()


def current_rss_bytes() -> int:
    """The process's resident set now (VmRSS), 0 where /proc is missing."""
    return _status_bytes("VmRSS")


def peak_bytes(device: torch.device | None = None) -> int:
    """Peak since the last ``reset_peak``: CUDA allocator peak on a GPU, else VmHWM (RSS)."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _status_bytes("VmHWM")


def cgroup_peak_bytes() -> int | None:
    """The cgroup's peak (cgroup v2 ``memory.peak``) where readable: page cache included, so a
    spill that only moved data into the page cache would show here."""
    try:
        return int(_CGROUP_PEAK.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _status_bytes(key: str) -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return 0


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null inside the block (C++ logging bypasses sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def profiler_running() -> bool:
    """Whether a torch profiler is on already (a user profiling this code): profilers do not
    nest, so ``AllocatorPeak`` cannot run inside it."""
    return bool(torch.autograd._profiler_enabled())


class AllocatorPeak:
    """The CPU allocator's peak growth over a block from torch.profiler's allocation events:
    every tensor and kernel workspace (frees of older blocks are not seen: over-counts)."""

    def __enter__(self) -> AllocatorPeak:
        from torch.profiler import ProfilerActivity, profile

        self.peak_bytes = 0
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():  # kineto prints a line at start and stop (torch >= 2.12)
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        with _quiet_stderr():
            self._profiler.__exit__(*exc)
        profiler = self._profiler.profiler
        assert profiler is not None and profiler.kineto_results is not None  # set by start/stop
        events = [e for e in profiler.kineto_results.events() if e.name() == "[memory]"]
        live = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            live += event.nbytes()  # type: ignore[attr-defined]  # torch's stub omits nbytes()
            self.peak_bytes = max(self.peak_bytes, live)
