"""WorkerPool (F15): a controller drives one persistent worker process per device through pipes
(docs/pool.md: the API, and the frames and processes under it)."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from phalanx.errors import PhalanxError, WorkerError
from phalanx.runtime.context import RuntimeConfig, init, shutdown

POLL_S = 0.2  # how often a waiting controller checks exit codes (a death is seen this fast)
_HEADER = struct.Struct("<Q")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


# -- errors -------------------------------------------------------------------------------------
class PoolError(PhalanxError):
    """The pool was used wrongly: closed, a bad rank, an unpicklable function or argument."""


class RemoteTraceback(Exception):
    """The traceback of a worker's exception, as text; chained as the ``__cause__``."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0]).rstrip()


class TaskError(WorkerError):
    """A function raised in a worker. ``exception`` is the original (when it could be
    unpickled), ``remote_traceback`` the worker's formatted traceback."""

    def __init__(
        self, rank: int, message: str, exception: BaseException | None, remote_traceback: str
    ) -> None:
        super().__init__(rank, message)
        self.exception = exception
        self.remote_traceback = remote_traceback


class WorkerDied(WorkerError):
    """A worker process exited or was killed; the pool shut the other workers down."""

    def __init__(self, rank: int, message: str, exit_code: int | None) -> None:
        super().__init__(rank, message)
        self.exit_code = exit_code


# -- inside a worker ----------------------------------------------------------------------------
@dataclass
class PoolWorker:
    """What a function running in a worker can see: ``current_worker()``."""

    rank: int
    world_size: int
    device: Any  # torch.device
    context: Any  # phalanx Context (process group, device, backend)
    state: types.SimpleNamespace = field(default_factory=types.SimpleNamespace)


_WORKER: PoolWorker | None = None


def current_worker() -> PoolWorker:
    """This worker's rank, device, Context and persistent ``state`` namespace."""
    if _WORKER is None:
        raise PoolError("current_worker() only works inside a function run by a WorkerPool worker")
    return _WORKER


def describe_exit(code: int | None) -> str:
    """'exit code 3' or 'signal SIGKILL' for a Popen return code."""
    if code is None:
        return "no exit code (still running)"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def function_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


# -- framing ------------------------------------------------------------------------------------
def _write_frame(pipe: IO[bytes], payload: bytes) -> None:
    """Length header then payload; raw pipes may write partially, so loop."""
    for chunk in (_HEADER.pack(len(payload)), payload):
        view = memoryview(chunk)
        while view:
            written = pipe.write(view)
            view = view[written or 0 :]


def _read_frame(pipe: IO[bytes]) -> bytes | None:
    """One frame, or None at end of file (the writer exited)."""
    header = _read_exact(pipe, _HEADER.size)
    if header is None:
        return None
    return _read_exact(pipe, _HEADER.unpack(header)[0])


def _read_exact(pipe: IO[bytes], size: int) -> bytes | None:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = pipe.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            return None
        got += n
    return bytes(buffer)


# -- the worker process -------------------------------------------------------------------------
def _worker_main(spec_json: str) -> None:
    """Entry of a worker process (``python -c``): join the group, then serve tasks until told
    to stop or the controller goes away."""
    spec = json.loads(spec_json)
    # Ctrl-C in a terminal reaches the whole process group: the controller decides what stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.path[:] = spec["sys_path"] + [p for p in sys.path if p not in spec["sys_path"]]
    inbox = io.FileIO(spec["in_fd"], "rb")
    outbox = io.FileIO(spec["out_fd"], "wb")
    _watch_parent(spec["parent_pid"], spec["tmp_dir"])
    try:
        worker = _join(spec)
    except BaseException as e:  # reported to the controller, which names the rank
        _write_frame(outbox, pickle.dumps(("error", _error_reply(e, "start-up:"))))
        raise SystemExit(1) from None
    ready = {"pid": os.getpid(), "device": str(worker.device)}
    _write_frame(outbox, pickle.dumps(("ready", ready)))
    try:
        _serve(inbox, outbox)
    finally:
        shutdown()


def _join(spec: dict[str, Any]) -> PoolWorker:
    """Bind the device and join the process group (phalanx.init), so the Engine works here."""
    global _WORKER
    kind = spec["device"].split(":")[0]
    config = RuntimeConfig(device=kind, **{k: spec[k] for k in ("backend", "threads", "timeout_s")})
    joining = {k: spec[k] for k in ("init_method", "rank", "world_size")}
    ctx = init(config, **joining)
    _WORKER = PoolWorker(ctx.rank, ctx.world_size, ctx.device, ctx)
    return _WORKER


def _watch_parent(parent_pid: int, tmp_dir: str) -> None:
    """Exit when the controller is gone, even in the middle of a task (no orphans). A killed
    controller cannot remove the pool's rendezvous folder, so its workers do."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="phalanx-pool-parent-watch", daemon=True).start()


def _serve(inbox: IO[bytes], outbox: IO[bytes]) -> None:
    while True:
        frame = _read_frame(inbox)
        if frame is None:  # the controller closed the pipe (or died)
            return
        message = pickle.loads(frame)
        if message[0] == "stop":
            return
        _, name, task, extra = message
        _write_frame(outbox, _execute(name, task, extra))


def _execute(name: str, task: bytes, extra: bytes | None) -> bytes:
    """Run one task; the reply is ("ok", pickled result) or ("error", error details)."""
    import cloudpickle

    try:
        fn, args, kwargs = cloudpickle.loads(task)
        if extra is not None:
            args = (cloudpickle.loads(extra), *args)
    except Exception as e:
        return pickle.dumps(("error", _error_reply(e, f"can't load {name} in the worker:")))
    try:
        result = fn(*args, **kwargs)
    except Exception as e:
        return pickle.dumps(("error", _error_reply(e, f"{name} raised")))
    try:
        return pickle.dumps(("ok", _dumps_result(result)))
    except Exception as e:
        return pickle.dumps(("error", _error_reply(e, f"the result of {name} can't be pickled:")))


def _error_reply(error: BaseException, doing: str) -> dict[str, Any]:
    blob: bytes | None
    try:
        blob = pickle.dumps(error)
        pickle.loads(blob)
    except Exception:
        blob = None
    return {
        "doing": doing,
        "type": type(error).__name__,
        "message": " ".join(str(error).split()),
        "traceback": traceback.format_exc(),
        "exception": blob,
    }


def _dumps_result(result: Any) -> bytes:
    """cloudpickle, with device tensors moved to the CPU so the controller never needs CUDA."""
    import cloudpickle
    import torch

    class ResultPickler(cloudpickle.CloudPickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
                return _same, (obj.detach().cpu(),)
            return super().reducer_override(obj)

    buffer = io.BytesIO()
    ResultPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(result)
    return buffer.getvalue()


def _same(x: Any) -> Any:
    return x


# -- the controller -----------------------------------------------------------------------------
@dataclass
class _Handle:
    """The controller's end of one worker."""

    rank: int
    device: str
    proc: subprocess.Popen
    to_worker: IO[bytes]  # write end of the worker's input pipe
    from_worker: IO[bytes]  # read end of the worker's output pipe
    forwarders: list[threading.Thread]
    busy: bool = True  # starting, or a task was sent and its reply not read yet
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class _PoolState:
    """Everything shutdown needs, kept apart from the pool so a finalizer can own it."""

    handles: list[_Handle] = field(default_factory=list)
    tmp_dir: str = ""


def _shutdown(state: _PoolState, grace_s: float = 5.0) -> None:
    """Stop every worker and reap it (no zombies): idle ones are asked to stop, busy ones (in
    a task, maybe waiting for a dead peer) are terminated; stragglers are killed."""
    for h in state.handles:
        if h.proc.poll() is None and not h.busy:
            try:
                _write_frame(h.to_worker, pickle.dumps(("stop",)))
            except OSError:
                pass
        _close_quietly(h.to_worker)
        if h.busy and h.proc.poll() is None:
            h.proc.terminate()
    deadline = time.monotonic() + grace_s
    for h in state.handles:
        _reap(h.proc, max(0.0, deadline - time.monotonic()))
    for h in state.handles:
        _close_quietly(h.from_worker)
        for thread in h.forwarders:
            thread.join(timeout=2.0)
    state.handles = []
    if state.tmp_dir:
        shutil.rmtree(state.tmp_dir, ignore_errors=True)


def _reap(proc: subprocess.Popen, timeout_s: float) -> None:
    for stop in (None, proc.terminate, proc.kill):
        if stop is not None:
            stop()
        try:
            proc.wait(timeout=timeout_s if stop is None else 5.0)
            return
        except subprocess.TimeoutExpired:
            continue


def _close_quietly(pipe: IO[bytes]) -> None:
    try:
        pipe.close()
    except OSError:
        pass


def _forward(stream: IO[bytes], rank: int, target: str) -> threading.Thread:
    """Copy a worker's stdout/stderr lines to the controller's (so prints reach a notebook)."""

    def pump() -> None:
        for raw in iter(stream.readline, b""):
            out = getattr(sys, target)
            try:
                out.write(f"[rank {rank}] {raw.decode(errors='replace')}")
                out.flush()
            except (OSError, ValueError):
                pass
        stream.close()

    thread = threading.Thread(target=pump, name=f"phalanx-pool-{target}-{rank}", daemon=True)
    thread.start()
    return thread


class WorkerPool:
    """A controller and ``num_workers`` persistent worker processes, one per device (F15).
    ``device``: "auto", "cpu", "cuda" (cuda:RANK) or one per worker; ``error_grace_s``: after a
    worker raised, how long the others may take before the pool presumes them stuck."""

    def __init__(
        self,
        num_workers: int,
        *,
        backend: str | None = None,
        device: str | Sequence[str] = "auto",
        threads: int = 1,
        timeout_s: float = 300.0,
        start_timeout_s: float = 120.0,
        error_grace_s: float = 5.0,
    ) -> None:
        devices = _resolve_devices(num_workers, device)
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"WorkerPool backend: got {backend!r}; allowed: gloo, nccl, None")
        if threads < 0 or timeout_s <= 0 or start_timeout_s <= 0 or error_grace_s < 0:
            raise ValueError("WorkerPool: threads >= 0, timeouts > 0 and error_grace_s >= 0")
        self.num_workers = num_workers
        self.error_grace_s = error_grace_s
        self._lock = threading.Lock()
        self._state = _PoolState(tmp_dir=tempfile.mkdtemp(prefix="phalanx-pool-"))
        self._finalizer = weakref.finalize(self, _shutdown, self._state)
        spec = {
            "world_size": num_workers,
            "init_method": f"file://{os.path.join(self._state.tmp_dir, 'rendezvous')}",
            "backend": backend or "auto",
            "threads": threads,
            "timeout_s": timeout_s,
            "sys_path": [p for p in sys.path if p],
            "parent_pid": os.getpid(),
            "tmp_dir": self._state.tmp_dir,
        }
        try:
            for rank, dev in enumerate(devices):
                self._state.handles.append(_start_worker(rank, dev, spec))
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise

    # -- public API -----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers, in rank order."""
        return [h.proc.pid for h in self._state.handles]

    @property
    def devices(self) -> list[str]:
        """The device each worker bound, in rank order (e.g. "cpu", "cuda:1")."""
        return [h.info.get("device", h.device) for h in self._state.handles]

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` in every worker; the results in rank order."""
        return self._dispatch(list(range(self.num_workers)), fn, args, kwargs, None)

    def run_on(self, rank: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in worker ``rank`` only (no collectives: the others idle)."""
        if not 0 <= rank < self.num_workers:
            raise PoolError(f"run_on: rank {rank} is not in [0, {self.num_workers})")
        return self._dispatch([rank], fn, args, kwargs, None)[0]

    def run_each(
        self, fn: Callable[..., Any], values: Sequence[Any], *args: Any, **kwargs: Any
    ) -> list[Any]:
        """``fn(values[r], *args, **kwargs)`` in worker r (one value per worker: e.g. its block
        of the data); the results in rank order."""
        if len(values) != self.num_workers:
            raise PoolError(f"run_each: got {len(values)} values for {self.num_workers} workers")
        return self._dispatch(list(range(self.num_workers)), fn, args, kwargs, list(values))

    def close(self) -> None:
        """Stop and reap every worker; safe to call again (and at exit, automatically)."""
        self._finalizer()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        status = "closed" if self.closed else f"devices={self.devices}"
        return f"WorkerPool(num_workers={self.num_workers}, {status})"

    # -- dispatch -------------------------------------------------------------------------------
    def _dispatch(
        self,
        ranks: list[int],
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict[str, Any],
        values: list[Any] | None,
    ) -> list[Any]:
        name = function_name(fn)
        task = _pickle_task(fn, args, kwargs, name)
        extras = [_pickle_value(v, name, r) for r, v in enumerate(values)] if values else None
        with self._lock:
            if self.closed:
                raise PoolError("the WorkerPool is closed")
            try:
                self._send(ranks, name, task, extras)
                replies = self._collect(ranks, name)
            except TaskError:  # every worker answered (or the pool closed itself): usable
                raise
            except BaseException:  # a death, or e.g. KeyboardInterrupt: replies are lost
                self.close()
                raise
        return [_unpickle_result(replies[r], name, r) for r in ranks]

    def _send(self, ranks: list[int], name: str, task: bytes, extras: list[bytes] | None) -> None:
        for r in ranks:
            h = self._state.handles[r]
            frame = pickle.dumps(("run", name, task, extras[r] if extras else None))
            try:
                _write_frame(h.to_worker, frame)
            except (BrokenPipeError, ConnectionResetError):
                raise self._death(h, name) from None
            h.busy = True

    def _collect(self, ranks: list[int], name: str) -> dict[int, bytes]:
        """Read one reply per rank; after an error give the others ``error_grace_s`` to
        answer, then close the pool (they are stuck in a collective)."""
        replies: dict[int, bytes] = {}
        errors: dict[int, dict[str, Any]] = {}
        deadline = [float("inf")]

        def stuck(ranks: list[int]) -> BaseException:
            self.close()
            return _task_error(errors, stuck_ranks=ranks)

        handles = [self._state.handles[r] for r in ranks]
        for h, status, payload in self._replies(handles, name, deadline, stuck, errors):
            if status == "ok":
                replies[h.rank] = payload
            else:
                errors[h.rank] = payload
                deadline[0] = min(deadline[0], time.monotonic() + self.error_grace_s)
        if errors:
            raise _task_error(errors)
        return replies

    def _replies(
        self,
        handles: list[_Handle],
        name: str,
        deadline: list[float],
        late: Callable[[list[int]], BaseException],
        errors: dict[int, dict[str, Any]] | None = None,
    ) -> Iterator[tuple[_Handle, str, Any]]:
        """Each worker's reply as it comes; a death raises WorkerDied, and workers still
        pending past ``deadline[0]`` raise ``late(their ranks)``."""
        pending = {h.from_worker: h for h in handles}
        while pending:
            ready, _, _ = select.select(list(pending), [], [], POLL_S)
            for pipe in ready:
                h = pending.pop(pipe)
                frame = _read_frame(pipe)
                if frame is None:
                    raise self._death(h, name, errors)
                h.busy = False
                yield (h, *pickle.loads(frame))
            for h in list(pending.values()):
                if h.proc.poll() is not None and not _readable(h.from_worker):
                    raise self._death(h, name, errors)
            if pending and time.monotonic() > deadline[0]:
                raise late(sorted(h.rank for h in pending.values()))

    def _death(
        self, h: _Handle, name: str, errors: dict[int, dict[str, Any]] | None = None
    ) -> WorkerDied:
        try:
            code = h.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = None
        message = (
            f"worker process {h.proc.pid} died ({describe_exit(code)}) while running {name}; "
            "the other workers were shut down"
        )
        others = [r for r in sorted(errors or {}) if r != h.rank]
        if others:
            message += f" (ranks {others} then failed too, likely because of it)"
        h.busy = code is None  # still running after closing its pipe: shutdown terminates it
        return WorkerDied(h.rank, message, code)

    def _wait_ready(self, timeout_s: float) -> None:
        """Each worker answers "ready" after joining the group, or its start-up error."""

        def late(ranks: list[int]) -> BaseException:
            return WorkerError(ranks[0], f"workers {ranks} did not start within {timeout_s} s")

        deadline = [time.monotonic() + timeout_s]
        for h, status, payload in self._replies(self._state.handles, "start-up", deadline, late):
            if status == "error":
                raise _task_error({h.rank: payload})
            h.info = payload


def _resolve_devices(num_workers: int, device: str | Sequence[str]) -> list[str]:
    """One device string per worker; explicit lists must cover every worker."""
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
        raise ValueError(f"WorkerPool num_workers: must be an int >= 1, got {num_workers!r}")
    explicit = [device] if isinstance(device, str) and ":" in device else device
    if isinstance(explicit, str):  # "auto", "cpu" or "cuda": one per rank
        names = [explicit] * num_workers
    else:
        names = list(explicit)
        if num_workers > len(names):
            raise ValueError(
                f"WorkerPool: {num_workers} workers but only {len(names)} devices given "
                f"({', '.join(map(str, names))})"
            )
        names = names[:num_workers]
    for name in names:
        if not isinstance(name, str) or not _DEVICE_RE.match(name):
            raise ValueError(
                f"WorkerPool device: got {name!r}; allowed: auto, cpu, cuda, cuda:N or a list"
            )
    return names


def _start_worker(rank: int, device: str, spec: dict[str, Any]) -> _Handle:
    """Spawn one worker with its two pipes; the controller keeps the other ends."""
    task_r, task_w = os.pipe()
    reply_r, reply_w = os.pipe()
    worker_spec = {**spec, "rank": rank, "device": device, "in_fd": task_r, "out_fd": reply_w}
    env = _worker_env(rank, device, spec["threads"])
    code = "from phalanx.runtime.pool import _worker_main; import sys; _worker_main(sys.argv[1])"
    try:
        command = [sys.executable, "-u", "-c", code, json.dumps(worker_spec)]
        pipe, null = subprocess.PIPE, subprocess.DEVNULL
        proc = subprocess.Popen(
            command, pass_fds=(task_r, reply_w), env=env, stdin=null, stdout=pipe, stderr=pipe
        )
    finally:  # the worker holds these ends now; closing ours makes its death an EOF here
        os.close(task_r)
        os.close(reply_w)
    assert proc.stdout is not None and proc.stderr is not None
    forwarders = [_forward(proc.stdout, rank, "stdout"), _forward(proc.stderr, rank, "stderr")]
    return _Handle(
        rank, device, proc, io.FileIO(task_w, "wb"), io.FileIO(reply_r, "rb"), forwarders
    )


def _worker_env(rank: int, device: str, threads: int) -> dict[str, str]:
    """The controller's environment minus launcher variables, plus the worker's own."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    package_root = str(Path(__file__).resolve().parents[2])  # the directory holding phalanx/
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    index = device.split(":")[1] if ":" in device else str(rank)
    env["LOCAL_RANK"] = index  # phalanx.init binds cuda:LOCAL_RANK
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _readable(pipe: IO[bytes]) -> bool:
    """Whether a reply (or EOF) is waiting: read it before judging an exit code."""
    return bool(select.select([pipe], [], [], 0)[0])


def _pickle_task(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], name: str) -> bytes:
    """cloudpickle of (fn, args, kwargs); PoolError naming what can't be pickled."""
    import cloudpickle

    try:
        return cloudpickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as whole:
        parts = [(f"function {name}", fn)]
        parts += [(f"argument {i} of {name}", a) for i, a in enumerate(args)]
        parts += [(f"argument {k}= of {name}", v) for k, v in kwargs.items()]
        for what, value in parts:
            try:
                cloudpickle.dumps(value)
            except Exception as e:
                raise PoolError(f"can't send {what} to the workers: {_oneline(e)}") from None
        raise PoolError(f"can't send {name} to the workers: {_oneline(whole)}") from None


def _pickle_value(value: Any, name: str, rank: int) -> bytes:
    import cloudpickle

    try:
        return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise PoolError(f"can't send the value for rank {rank} of {name}: {_oneline(e)}") from None


def _unpickle_result(blob: bytes, name: str, rank: int) -> Any:
    try:
        return pickle.loads(blob)
    except Exception as e:
        raise PoolError(f"can't load the result of {name} from rank {rank}: {_oneline(e)}") from e


def unpickled_error(blob: bytes | None) -> BaseException | None:
    """A worker's pickled exception, or None where there is none or it cannot be loaded."""
    try:
        return None if blob is None else pickle.loads(blob)
    except Exception:
        return None


def _oneline(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _task_error(
    errors: dict[int, dict[str, Any]], stuck_ranks: list[int] | None = None
) -> TaskError:
    """The lowest failed rank's error, with its remote traceback chained as the cause."""
    rank = min(errors)
    e = errors[rank]
    message = f"{e['doing']} {e['type']}: {e['message']}"
    if len(errors) > 1:
        message += f" (ranks {sorted(errors)} failed)"
    if stuck_ranks:
        message += (
            f"; ranks {stuck_ranks} did not finish within the grace period (stuck in a collective"
            " waiting for the failed rank?), so the pool was closed"
        )
    error = TaskError(rank, message, unpickled_error(e["exception"]), e["traceback"])
    error.__cause__ = RemoteTraceback(e["traceback"])
    return error
