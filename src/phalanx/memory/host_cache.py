"""A caching CPU allocator held under the budget: freed host tensors are kept for reuse, as
CUDA's caching allocator keeps device memory, but never lift the process's resident size above
a limit (host_cache.cpp says how).

Without it a memory budget on a CPU device has to give every freed tensor back to the OS
(``measure.release_freed_memory``) so that the process's resident peak falls, and each step's
new tensors then map, fault in and zero fresh pages: measured on the GPT of configs/ at 75% of
its unmanaged peak, 1.37x the unmanaged step with every activation kept (docs/benchmarks.md).

The allocator is C++ (torch's ``c10::SetCPUAllocator`` is not reachable from Python), built
once per torch version into ``<cache dir>/host_cache/<torch version>/`` with
``torch.utils.cpp_extension`` (C10 headers only: seconds) and loaded with ctypes, torch's own
warnings held back meanwhile (``optional.torch_quiet``: a CUDA build of torch without a GPU logs
"No CUDA runtime is found" there). Where it cannot be built (no C++ compiler or ninja) one
warning line says why (``optional.optional``) and the budget falls back to releasing freed
memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from phalanx.fileio import cache_dir
from phalanx.optional import optional, torch_quiet

MIN_BYTES = 1 << 16  # blocks from this size up are cached (the size glibc would map on its own)
SOURCE = Path(__file__).with_name("host_cache.cpp")
logger = logging.getLogger("phalanx")


@dataclass(frozen=True, kw_only=True)
class CacheStats:
    """What the cache did since it was installed."""

    hits: int  # requests served by a cached block
    misses: int  # requests that mapped a fresh block
    released: int  # cached blocks given back to the OS to stay under the limit
    cached_bytes: int  # held for reuse now


def _build_dir() -> Path:
    return cache_dir() / "host_cache" / torch.__version__.replace("+", "-")


@functools.cache
def library() -> ctypes.CDLL | str:
    """The built allocator, or one line saying why it could not be built here."""
    if not Path("/proc/self/statm").is_file():
        return "no /proc/self/statm to read the resident size from (Linux only)"
    why: list[str] = []
    lib = optional(
        _build,
        None,
        what="host cache not built",
        instead="freed host memory goes back to the OS instead (slower steps, docs/memory.md)",
        again="install a C++ compiler and ninja, then run again",
        notes=why,
    )
    return why[0] if lib is None else lib


def _build() -> ctypes.CDLL:
    with torch_quiet():
        from torch.utils.cpp_extension import load, verify_ninja_availability

        verify_ninja_availability()
        build = _build_dir()
        build.mkdir(parents=True, exist_ok=True)
        path = load(
            name="phalanx_host_cache",
            sources=[str(SOURCE)],
            build_directory=str(build),
            extra_cflags=["-O2"],
            is_python_module=False,
            verbose=False,
        )
    lib = ctypes.CDLL(str(path))
    lib.phalanx_host_cache_install.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.phalanx_host_cache_install.restype = ctypes.c_int
    lib.phalanx_host_cache_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    return lib


_problem: str | None = "not installed"  # why the cache is not in force (None: it is)
_limit = 0  # bytes: the resident size the cache keeps the process under


def install(limit_bytes: int) -> str | None:
    """Make torch's CPU allocator a cache that keeps freed blocks while the process's resident
    size stays under ``limit_bytes`` (absolute, as ``measure.current_rss_bytes`` counts it; a
    later call changes the limit). Returns None when in force, else one line saying why not."""
    global _problem, _limit
    lib = library()
    if isinstance(lib, str):
        _problem = lib
    elif not lib.phalanx_host_cache_install(MIN_BYTES, int(limit_bytes)):
        _problem = "torch's CPU allocator was set elsewhere at a higher priority"
    else:
        _problem, _limit = None, int(limit_bytes)
    return _problem


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Nothing freed is kept inside (the cache emptied first): the memory manager's profile
    measures a step as the allocator before the cache runs it."""
    lib = library() if _problem is None else None
    if lib is None or isinstance(lib, str):
        yield
        return
    lib.phalanx_host_cache_install(MIN_BYTES, 0)
    lib.phalanx_host_cache_empty()
    try:
        yield
    finally:
        lib.phalanx_host_cache_install(MIN_BYTES, _limit)


def empty() -> None:
    """Give every cached block back to the OS now (``measure.trim`` does: a profile measures
    what the process holds, and blocks kept for reuse would read as held)."""
    lib = library() if _problem is None else None
    if lib is not None and not isinstance(lib, str):
        lib.phalanx_host_cache_empty()


def problem() -> str | None:
    """Why the cache is not in force in this process (None: it is)."""
    return _problem


def stats() -> CacheStats | None:
    """The cache's counters (None when it was never built or installed in this process)."""
    lib = library()
    if isinstance(lib, str):
        return None
    out = (ctypes.c_int64 * 4)()
    lib.phalanx_host_cache_stats(out)
    return CacheStats(hits=out[0], misses=out[1], released=out[2], cached_bytes=out[3])
