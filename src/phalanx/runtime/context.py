"""``phalanx.init()``: join the process group, bind one device per process (F1), return a Context.

One code path for every world size: a world of one is a real single-rank process group (on an
in-memory store), so collectives, buckets and strategies run the same code everywhere.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import gc
import logging
import os
import sys
import types
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from phalanx.fields import option, require
from phalanx.memory import measure
from phalanx.optional import torch_quiet

Backend = Literal["auto", "gloo", "nccl"]
DeviceKind = Literal["auto", "cpu", "cuda"]


@dataclass(kw_only=True)
class RuntimeConfig:
    """How a process joins the group and which device it drives."""

    backend: Backend = option("auto", "collective backend; auto = nccl for CUDA, gloo for CPU")
    device: DeviceKind = option("auto", "auto = cuda:LOCAL_RANK when CUDA is available, else cpu")
    threads: int = option(1, "intra-op threads per CPU process (0 = leave torch's default)")
    timeout_s: float = option(300.0, "collective timeout in seconds; a dead peer fails after it")
    share_device: bool = option(
        False,
        "tests on one GPU only: every rank drives cuda:0 and the backend is Gloo (NCCL refuses "
        "two ranks on one device), so each strategy runs on CUDA tensors, streams and events "
        "with several ranks; step times mean nothing. Warned at start",
    )
    reuse_host_memory: bool = option(
        True,
        "CPU processes: freed tensors up to 32 MiB stay in the heap for the next step "
        "(glibc's mmap threshold fixed; measured ~25% faster steps on a wide MLP); false: "
        "glibc's defaults. [memory] release_host_memory takes over while it is on",
    )

    def __post_init__(self) -> None:
        require(self.threads >= 0, "threads", f"must be >= 0, got {self.threads}")
        require(self.timeout_s > 0, "timeout_s", f"must be > 0, got {self.timeout_s}")
        require(
            not (self.share_device and self.backend == "nccl"),
            "share_device",
            "NCCL refuses two ranks on one device; leave backend = 'auto' (Gloo) with it",
        )


@dataclass(frozen=True)
class Context:
    """Where this process sits: its rank, the world, its device and the backend in use."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    group: dist.ProcessGroup

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def shutdown(self) -> None:
        shutdown()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        shutdown()


_CONTEXT: Context | None = None
# Teardowns of objects that use the process group (Engines: pending send-backs, communication
# threads). They run before the group is destroyed, newest first: destroying a Gloo group while
# a thread still waits in it aborts the process ("terminate called without an active exception").
_TEARDOWNS: list[Callable[[], None]] = []
# Backend Work objects whose last release must not fall to a backend worker thread (see
# ``hold_until_shutdown``); released by ``shutdown`` once their groups' threads are joined.
_HELD_WORKS: list[Any] = []
logger = logging.getLogger("phalanx")


def hold_until_shutdown(works: Iterable[Any]) -> None:
    """Keep backend ``Work`` objects until the process groups that ran them are destroyed: a
    Gloo thread dropping the last reference during interpreter finalization aborts the process
    (docs/reliability.md, "Exit")."""
    _HELD_WORKS.extend(works)


def on_shutdown(teardown: Callable[[], None]) -> Callable[[], None]:
    """Run ``teardown`` at ``shutdown()`` (and so at interpreter exit) before the process group
    goes; returns a function that unregisters it (for objects closed earlier by hand)."""
    _TEARDOWNS.append(teardown)
    return lambda: unregister_shutdown(teardown)


def unregister_shutdown(teardown: Callable[[], None]) -> None:
    """Forget ``teardown`` (it ran already, or its object was closed by hand)."""
    if teardown in _TEARDOWNS:
        _TEARDOWNS.remove(teardown)


def current_context() -> Context:
    """The Context of ``init()``; calls ``init()`` with defaults if nothing joined yet."""
    return _CONTEXT if _CONTEXT is not None else init()


def init(
    config: RuntimeConfig | None = None,
    *,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> Context:
    """Join the process group (a launcher's RANK, WORLD_SIZE, ... or a world of one) and bind
    this process's device; calling it again returns the existing Context."""
    global _CONTEXT
    if _CONTEXT is not None:
        return _CONTEXT
    config = config or RuntimeConfig()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _pick_device(config.device, 0 if config.share_device else local_rank)
    backend = _pick_backend(config.backend, device, config.share_device)
    if config.share_device and device.type == "cuda" and local_rank == 0:
        logger.warning(
            "phalanx: warning: runtime.share_device: every rank drives %s over Gloo; for "
            "tests of the CUDA paths only, step times mean nothing",
            device,
        )
    if device.type == "cpu" and config.threads > 0:
        torch.set_num_threads(config.threads)
    if device.type == "cpu" and config.reuse_host_memory:
        measure.reuse_freed_memory()
    if not dist.is_initialized():
        with torch_quiet():  # torch's set-up warnings would precede a one-line error
            _join_group(backend, config.timeout_s, init_method, rank, world_size)
    group = dist.group.WORLD
    assert group is not None
    _run_shutdown_on_destroy()
    rank, world = dist.get_rank(), dist.get_world_size()
    _CONTEXT = Context(rank, world, local_rank, device, dist.get_backend(), group)
    atexit.register(shutdown)
    return _CONTEXT


def shutdown() -> None:
    """Teardowns (newest first), then every process group, then the held works (idempotent;
    at exit too): the backend's threads are joined while the interpreter is fully alive."""
    global _CONTEXT
    while _TEARDOWNS:
        teardown = _TEARDOWNS.pop()
        try:
            teardown()
        except Exception as e:  # noqa: BLE001 - the group must still be destroyed
            logger.warning("phalanx: teardown at shutdown failed: %s: %s", type(e).__name__, e)
    # Phase 2: groups
    groups = _live_groups()
    if _CONTEXT is not None:
        object.__setattr__(_CONTEXT, "group", None)  # a user's `ctx` must not keep it alive
    _CONTEXT = None
    if dist.is_initialized():
        (_ORIGINAL_DESTROY or dist.destroy_process_group)()
    _forget_captured_groups(groups)
    # Phase 3: held works
    _release_held_works(groups)


# torch's destroy_process_group as it was before ``_run_shutdown_on_destroy`` re-pointed it
_ORIGINAL_DESTROY: Callable[..., None] | None = None


def _run_shutdown_on_destroy() -> None:
    """Make a script's own ``dist.destroy_process_group()`` run ``shutdown()`` (else a pending
    exchange breaks). torch has no hook, so the function's code is replaced in place: a
    reference imported earlier is the same object. Another shape is left alone."""
    global _ORIGINAL_DESTROY
    from torch.distributed import distributed_c10d as c10d

    function = c10d.destroy_process_group
    code = function.__code__
    if _ORIGINAL_DESTROY is not None or not _takes_group_only(function):
        return
    original = types.FunctionType(code, function.__globals__, function.__name__)
    original.__defaults__ = function.__defaults__
    c10d.__dict__["_phalanx_destroy"] = _destroy
    function.__code__ = _destroy_in_torch.__code__
    _ORIGINAL_DESTROY = original


def _takes_group_only(function: Any) -> bool:
    """torch's ``destroy_process_group(group=None)``: a plain function of that one argument."""
    code = getattr(function, "__code__", None)
    return (
        isinstance(function, types.FunctionType)
        and code is not None
        and not function.__closure__
        and code.co_argcount == 1
        and code.co_kwonlyargcount == 0
        and code.co_varnames[:1] == ("group",)
        and function.__defaults__ == (None,)
    )


def _destroy_in_torch(group: Any = None) -> None:
    """The code torch's ``destroy_process_group`` runs once re-pointed (with torch's module
    globals, where ``_phalanx_destroy`` is phalanx's ``_destroy``)."""
    return _phalanx_destroy(group)  # type: ignore[name-defined]  # noqa: F821


def _destroy(group: Any) -> None:
    """The whole world while phalanx holds a Context: ``shutdown()``; else torch's own."""
    assert _ORIGINAL_DESTROY is not None
    if _CONTEXT is not None and (group is None or group is dist.group.WORLD):
        shutdown()
        return
    _ORIGINAL_DESTROY(group)


def _live_groups() -> list[weakref.ref]:
    """Weak references to every process group this process has."""
    if not dist.is_initialized():
        return []
    from torch.distributed import distributed_c10d

    return [weakref.ref(pg) for pg in list(distributed_c10d._world.pg_map)]


def _alive(groups: list[weakref.ref]) -> list[Any]:
    return [group for ref in groups if (group := ref()) is not None]


def _forget_captured_groups(groups: list[weakref.ref]) -> None:
    """Replace destroyed groups captured as default arguments of module-level functions with
    None (docs/reliability.md): torch.distributed.nn.functional's would keep Gloo's threads
    into finalization. gc's referrers miss them (such a tuple is untracked)."""
    gc.collect()  # groups held only by reference cycles (closed Engines) go now
    alive = _alive(groups)
    if not alive:
        return
    dead = {id(group) for group in alive}
    del alive  # only ids from here: the last references may go in the loop below
    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            if type(value) is not types.FunctionType:  # (isinstance would ask proxies)
                continue
            if value.__defaults__ and any(id(d) in dead for d in value.__defaults__):
                value.__defaults__ = tuple(None if id(d) in dead else d for d in value.__defaults__)
            named = value.__kwdefaults__
            if named and any(id(d) in dead for d in named.values()):
                value.__kwdefaults__ = {k: None if id(d) in dead else d for k, d in named.items()}
    if left := len(_alive(groups)):
        logger.debug("phalanx: %d process group(s) outlive shutdown", left)


def _release_held_works(groups: list[weakref.ref]) -> None:
    if not _HELD_WORKS:
        return
    if _alive(groups):
        # Someone still holds a group, so its worker threads run until the interpreter
        # clears it: keep the works past that point rather than risk the last release there.
        for work in _HELD_WORKS:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))
    _HELD_WORKS.clear()


def _pick_device(kind: str, local_rank: int) -> torch.device:
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("runtime.device = 'cuda' but CUDA is not available in this process")
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(
            f"LOCAL_RANK {local_rank} has no GPU: only {torch.cuda.device_count()} visible"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _pick_backend(name: str, device: torch.device, share_device: bool = False) -> str:
    if name != "auto":
        return name
    return "nccl" if device.type == "cuda" and not share_device else "gloo"


def _join_group(
    backend: str, timeout_s: float, init_method: str | None, rank: int | None, world: int | None
) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    if init_method is not None:
        assert rank is not None and world is not None, "init_method needs rank and world_size"
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout
        )
    elif _restarted_under_agent():
        _join_restarted_group(backend, timeout)
    elif "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:  # a world of one: same code path, a store in memory
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )


def _restarted_under_agent() -> bool:
    """A worker the elastic agent restarted (``--max-restarts``), using the agent's store."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _join_restarted_group(backend: str, timeout: datetime.timedelta) -> None:
    """Join through the agent's store under a prefix of this attempt: the store outlives
    restarts, and without one a rank could read its peers' addresses from before."""
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    shared = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"phalanx/attempt_{attempt}", shared)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
