"""``run_ranks``: one function in ``world_size`` fresh processes in one process group, the runner
of the benchmarks and tests; file rendezvous in a private directory (no ports: parallel runs
don't race); a failing rank is ``RankFailed``, the others stopped; no process outlives the call.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from phalanx.errors import PEER_LOSS, WorkerError
from phalanx.runtime import context
from phalanx.runtime.context import RuntimeConfig
from phalanx.runtime.pool import RemoteTraceback, unpickled_error

POLL_S = 0.2  # how often the caller looks for error files (exits are seen at once)
SETTLE_S = 0.2  # after a first failure: time for a peer's error or signal to show
STOP_GRACE_S = 30.0  # after every result: time for the ranks to exit on their own


class RankFailed(WorkerError):
    """A rank raised or died; the others were stopped. ``exit_code``: negative for a signal,
    None when it was still running when stopped."""

    def __init__(
        self,
        rank: int,
        message: str,
        *,
        exception: BaseException | None = None,
        remote_traceback: str = "",
        exit_code: int | None = None,
    ) -> None:
        super().__init__(rank, message)
        self.exception = exception
        self.remote_traceback = remote_traceback
        self.exit_code = exit_code


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = 120.0,
    runtime: RuntimeConfig | None = None,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """``fn(ctx, *args)`` (picklable) in each of ``world_size`` ranks; results in rank order.
    ``timeout``: seconds for the whole run (None: no limit); ``env``: set in each rank before
    ``phalanx.init``."""
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"run_ranks world_size: must be >= 1, got {world_size}")
    runtime = runtime or RuntimeConfig(threads=1, timeout_s=60.0)
    with tempfile.TemporaryDirectory(prefix="phalanx-ranks-") as tmp:
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        # The caller's environment and directory as they are now: forked ranks would otherwise
        # see the forkserver's, from when it started.
        rank_env = {**os.environ, **(env or {})}
        entry_args = (fn, args, world_size, init_method, runtime, rank_env, tmp, os.getcwd())
        method = _start_method()
        procs = mp.start_processes(
            _rank_main, entry_args, world_size, join=False, daemon=True, start_method=method
        ).processes
        finished = False
        try:
            _wait(procs, tmp, timeout)
            finished = True
        finally:  # after a failure the others may sit in a collective: stop them at once
            _stop(procs, grace_s=STOP_GRACE_S if finished else 0.0)
        return [_load(_result_path(tmp, r)) for r in range(world_size)]


def _start_method() -> str:
    """``forkserver`` with torch and phalanx preloaded (a rank starts without 1.5 s of import;
    the server has no CUDA and no threads, so forking it is safe), else ``spawn``."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "phalanx"])
    return "forkserver"


# -- in each rank -------------------------------------------------------------------------------
def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    args: tuple,
    world_size: int,
    init_method: str,
    runtime: RuntimeConfig,
    env: dict[str, str],
    out_dir: str,
    cwd: str,
) -> None:
    """Join, run, shut down, then hand the result over; an error is reported before shutdown
    (so the caller stops the other ranks at once) and the rank exits with code 1."""
    import io

    import torch

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ["LOCAL_RANK"] = str(rank)  # phalanx.init binds cuda:LOCAL_RANK
    os.environ["RANK"] = str(rank)  # as torchrun sets it (fault injection reads it)
    payload, failed = b"", False
    try:
        ctx = context.init(runtime, init_method=init_method, rank=rank, world_size=world_size)
        buffer = io.BytesIO()
        torch.save(fn(ctx, *args), buffer)
        payload = buffer.getvalue()
    except BaseException as e:
        _write_error(out_dir, rank, e)
        failed = True
    try:
        context.shutdown()
    except BaseException as e:
        if not failed:
            _write_error(out_dir, rank, e)
            failed = True
    if failed:
        sys.exit(1)
    _write_atomic(_result_path(out_dir, rank), payload)


def _write_error(out_dir: str, rank: int, error: BaseException) -> None:
    try:
        exception = pickle.dumps(error)
    except Exception:
        exception = None
    info = {
        "summary": f"{type(error).__name__}: {error}",
        "traceback": traceback.format_exc(),
        "exception": exception,
        "time": time.time(),
    }
    _write_atomic(_error_path(out_dir, rank), pickle.dumps(info))


def _write_atomic(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def _result_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.result")


def _error_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.error")


# -- in the caller ------------------------------------------------------------------------------
def _wait(procs: list[Any], out_dir: str, timeout: float | None) -> None:
    """Until every rank has handed over its result; raise for the first failure or timeout."""
    from multiprocessing.connection import wait

    deadline = None if timeout is None else time.monotonic() + timeout
    pending = set(range(len(procs)))
    while pending:
        running = [procs[r].sentinel for r in pending if procs[r].exitcode is None]
        if running:
            wait(running, timeout=POLL_S)  # wakes as soon as a rank exits
        pending = {r for r in pending if not os.path.exists(_result_path(out_dir, r))}
        if any(_failed(procs, out_dir, r) for r in pending):
            time.sleep(SETTLE_S)
            raise _failure(procs, out_dir)
        if deadline is not None and pending and time.monotonic() > deadline:
            raise TimeoutError(
                f"ranks {sorted(pending)} did not finish within {timeout} s; every rank was stopped"
            )


def _failed(procs: list[Any], out_dir: str, rank: int) -> bool:
    exited = procs[rank].exitcode is not None
    return os.path.exists(_error_path(out_dir, rank)) or (
        exited and not os.path.exists(_result_path(out_dir, rank))
    )


@dataclass
class _Failure:
    rank: int
    exit_code: int | None
    info: dict[str, Any] | None  # the rank's error file, if it wrote one

    @property
    def signal_name(self) -> str | None:
        if self.exit_code is None or self.exit_code >= 0:
            return None
        try:
            return signal.Signals(-self.exit_code).name
        except ValueError:
            return str(-self.exit_code)

    @property
    def message(self) -> str:
        if self.info is not None:
            return self.info["summary"]
        if self.signal_name is not None:
            return f"killed by signal {self.signal_name}"
        if self.exit_code == 0:
            return "process exited without sending results"
        return f"process exited with exit code {self.exit_code}"

    def key(self) -> tuple[bool, bool, bool, float, int]:
        """Sort key, cause first: killed by a signal, own error, any error, earliest, rank."""
        consequence = any(p in self.message.lower() for p in PEER_LOSS)
        when = self.info["time"] if self.info is not None else float("inf")
        return (self.signal_name is None, consequence, self.info is None, when, self.rank)


def _failure(procs: list[Any], out_dir: str) -> RankFailed:
    """RankFailed for the root cause among the failed ranks."""
    failures = []
    for rank, p in enumerate(procs):
        if _failed(procs, out_dir, rank):
            info = None
            if os.path.exists(_error_path(out_dir, rank)):
                with open(_error_path(out_dir, rank), "rb") as f:
                    info = pickle.load(f)
            failures.append(_Failure(rank, p.exitcode, info))
    cause = min(failures, key=_Failure.key)
    others = [f for f in failures if f is not cause]
    message = cause.message
    seen = [f for f in others if f.info is not None]
    if cause.info is None and seen:  # a rank that died: what a peer saw explains it
        message += f" (rank {seen[0].rank} saw: {cast(dict, seen[0].info)['summary']})"
    elif others:
        message += f" (ranks {[f.rank for f in others]} failed too)"
    info = cause.info or {}
    exception = unpickled_error(info.get("exception"))
    remote = info.get("traceback", "")
    error = RankFailed(
        cause.rank, message, exception=exception, remote_traceback=remote, exit_code=cause.exit_code
    )
    if remote:
        error.__cause__ = RemoteTraceback(remote)
    return error


def _stop(procs: list[Any], grace_s: float) -> None:
    """Join every rank within ``grace_s``; terminate, then kill, what is left; reap all."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for stop in ("terminate", "kill"):
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            getattr(p, stop)()
        for p in alive:
            p.join(timeout=5.0)


def _load(path: str) -> Any:
    import torch

    return torch.load(path, weights_only=False)
