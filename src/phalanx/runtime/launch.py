"""Start local workers through torch's elastic launcher (``torchrun``'s engine), with torchrun's
environment, so one entry point serves both; several machines use the static rendezvous."""

from __future__ import annotations

import logging
import signal
import socket
import sys
import uuid
from dataclasses import dataclass
from typing import Any

from phalanx.errors import PEER_LOSS, ConfigError, Interrupted, WorkerError


@dataclass(kw_only=True)
class LaunchSpec:
    """Where the workers of one run come from."""

    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port (single node only)
    threads: int = 1  # OMP_NUM_THREADS of each worker
    max_restarts: int = 0  # restart the whole group this many times after a worker dies
    # When the launcher itself is signalled: seconds the workers get between the signal and
    # SIGKILL, long enough for a step and the preemption checkpoint. (After a worker failure,
    # torch elastic stops the rest with its own fixed 30 s.)
    stop_grace_s: int = 30
    debug: bool = False

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {self.nproc}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ConfigError("--master-port is required with --nnodes > 1")
        if self.stop_grace_s < 0:
            raise ConfigError(f"--stop-grace must be >= 0, got {self.stop_grace_s}")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch(spec: LaunchSpec, python_args: list[str]) -> None:
    """Run ``python -u *python_args`` in spec.nproc workers on this node; wait for all.
    WorkerError names the rank that caused a failure (the others are stopped, or the group
    restarted ``max_restarts`` times); Interrupted when this process is signalled."""
    import os
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not spec.debug:
        _quiet_elastic_loggers()
    port = spec.master_port or free_port(spec.master_addr)
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.threads))
    # The agent's folder of per-rank error files: its own default is a fresh /tmp/torchelastic_*
    # that nothing removes (one per run); the failures are read before it goes.
    log_dir = tempfile.TemporaryDirectory(prefix="phalanx-launch-", ignore_cleanup_errors=True)
    config = LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc,
        run_id=f"phalanx-{port}" if spec.nnodes > 1 else uuid.uuid4().hex[:12],
        rdzv_backend="static",
        rdzv_endpoint=f"{spec.master_addr}:{port}",
        rdzv_configs={"rank": spec.node_rank, "timeout": 120},
        max_restarts=spec.max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir.name),
        **_grace_option(spec.stop_grace_s),
    )
    try:
        elastic_launch(config, sys.executable)("-u", *python_args)
    except ChildFailedError as e:
        raise WorkerError(*_describe(e.failures)) from None
    except SignalException as e:
        raise Interrupted(int(e.sigval)) from None
    finally:
        log_dir.cleanup()


def _grace_option(seconds: int) -> dict[str, Any]:
    """LaunchConfig's ``shutdown_timeout`` where this torch has it (older releases always
    wait 30 s)."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    names = {f.name for f in dataclasses.fields(LaunchConfig)}
    return {"shutdown_timeout": seconds} if "shutdown_timeout" in names else {}


def _quiet_elastic_loggers() -> None:
    """Silence torch elastic's own warnings: phalanx prints one line per outcome. Its modules
    set their loggers' levels themselves, so each needs it."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


# A rank that loses its peer fails too ("connection closed by peer"), often within the same
# second as the rank that really failed, and the launcher then stops the others with SIGTERM:
# both are consequences, not the cause.
# Signals the launcher itself sends to stop the ranks that are left.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOPPED = ("stopped by sigterm", "stopped by sigint")  # phalanx.errors.Interrupted
SIGNAL_HINTS = {
    signal.SIGKILL: "killed — out of memory?",
    signal.SIGSEGV: "crashed (segmentation fault)",
    signal.SIGBUS: "crashed (bus error)",
    signal.SIGABRT: "aborted",
    signal.SIGFPE: "crashed (floating-point exception)",
}


# A rank killed this long after another rank's own error was killed by the launcher (it
# stopped responding and ignored SIGTERM), not by the cause of the failure.
LATE_KILL_S = 3


def _root_cause(failures: dict[int, Any]) -> tuple[int, Any]:
    """The failure to report: a rank a signal killed (not the launcher's stop) unless another's
    own error came well before; an own error before a lost peer or a stop; a message before a
    bare exit code; then the earliest (whole seconds: they tie), then the lowest rank."""
    first_own = min((_timestamp(f) for f in failures.values() if _is_own_error(f)), default=None)

    def key(item: tuple[int, Any]) -> tuple[bool, bool, bool, int, int]:
        rank, failure = item
        message = _failure_message(failure).lower()
        killed = _killed(failure) and not (
            first_own is not None and _timestamp(failure) - first_own >= LATE_KILL_S
        )
        bare = message.startswith("exit code")
        return (not killed, _is_consequence(failure), bare, _timestamp(failure), rank)

    return min(failures.items(), key=key)


def _describe(failures: dict[int, Any]) -> tuple[int, str]:
    """(rank, message) for WorkerError: the root cause, plus the ranks the launcher had to
    kill because they stopped responding (a hang shows as a peer's timeout)."""
    rank, failure = _root_cause(failures)
    message = _failure_message(failure)
    late = sorted(
        r for r, f in failures.items()
        if r != rank and _killed(f) and _timestamp(f) - _timestamp(failure) >= LATE_KILL_S
    )  # fmt: skip
    if late:
        names = ", ".join(map(str, late))
        message += f"; rank {names} stopped responding and was killed by the launcher"
    return rank, message


def _timestamp(failure: object) -> int:
    return int(getattr(failure, "timestamp", 0) or 0)


def _killed(failure: object) -> bool:
    signum = _signal_of(failure)
    return signum is not None and signum not in STOP_SIGNALS


def _is_consequence(failure: object) -> bool:
    """A lost peer, or the launcher's own stop of a rank that had recorded no error of its
    own (a rank that did, and was stopped while it exited, failed by itself)."""
    message = _failure_message(failure).lower()
    if any(p in message for p in (*PEER_LOSS, *STOPPED)):
        return True
    return _signal_of(failure) in STOP_SIGNALS and not _recorded(failure)


def _is_own_error(failure: object) -> bool:
    signum = _signal_of(failure)
    return (
        (signum is None or (signum in STOP_SIGNALS and bool(_recorded(failure))))
        and not _is_consequence(failure)
        and not _failure_message(failure).startswith("exit code")
    )


def _signal_of(failure: object) -> signal.Signals | None:
    """The signal that ended the rank (exit code -N), or None for a normal exit."""
    exitcode = getattr(failure, "exitcode", 0) or 0
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode)
    except ValueError:
        return None


def _failure_message(failure: object) -> str:
    signum = _signal_of(failure)
    recorded = _recorded(failure)
    if signum in STOP_SIGNALS and recorded:  # its own error, then the launcher's stop
        return f"{recorded} (then stopped by the launcher, {signum.name})"
    if signum is not None:
        hint = SIGNAL_HINTS.get(signum, "killed")
        return f"{hint} ({signum.name}, pid {getattr(failure, 'pid', '?')})"
    exitcode = getattr(failure, "exitcode", None)
    if not recorded:
        return f"exit code {exitcode}"
    return f"{recorded} (exit code {exitcode})"


def _recorded(failure: object) -> str:
    """The first line of the error the rank recorded in its error file ("" if none)."""
    message = getattr(failure, "message", "") or ""
    if isinstance(message, dict):  # the error file's structure
        message = message.get("message", "")
    lines = str(message).strip().splitlines()
    first = lines[0] if lines else ""
    if first.startswith("To enable traceback") or first.startswith("Signal "):
        return ""  # torch elastic's placeholders, not an error of the rank's own
    return first
