"""Peak memory, counted honestly: the process's resident set (and its cgroup's, where readable),
or the CUDA allocator's peak on GPUs; and the CPU allocator's peak over a block of code
(``AllocatorPeak``), which sees every tensor and kernel workspace.

On a CPU-only machine "device memory" is the process's RSS. ``reset_peak()`` resets the kernel's
high-water mark (writing 5 to /proc/self/clear_refs, Linux >= 4.0) so ``peak_bytes()`` covers
only what ran since. Freed tensors only lower RSS when the allocator returns them to the kernel:
glibc keeps small and mid-size blocks in its heap, so measuring processes should start with
``MALLOC_MMAP_THRESHOLD_`` set low (``allocator_env()``), which makes every large tensor its own
mapping, unmapped when freed.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

MMAP_THRESHOLD = 1 << 16  # bytes: blocks above this get their own mapping (freed to the kernel)
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_CGROUP_PEAK = Path("/sys/fs/cgroup/memory.peak")


def allocator_env() -> dict[str, str]:
    """Environment for a measuring process: large blocks are mmapped, so frees show in RSS."""
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}


def reset_peak(device: torch.device | None = None) -> bool:
    """Start a new peak; returns whether the host peak could be reset (Linux only)."""
    if device is not None and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


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
    """The CPU allocator's peak growth over a block (bytes above the live bytes at its
    start), from torch.profiler's allocation events: every tensor, autograd's temporaries
    and kernels' workspaces (oneDNN allocates through the same allocator), which an accounting
    of saved tensors does not see. Frees of blocks allocated before the block are not seen,
    so the peak can only be over-counted."""

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
