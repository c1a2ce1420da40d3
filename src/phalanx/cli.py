"""The ``phalanx`` command: parse the verb (phalanx.commands), run it, and turn errors into one
line and an exit code.

User mistakes print one line and exit with code 2 (``--debug`` shows the traceback); a failed
worker exits 1 with the rank and its error.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx import __version__
from phalanx.commands import build_parser as build
from phalanx.commands.common import EXIT_INTERRUPTED, EXIT_PREEMPTED, PROG  # noqa: F401
from phalanx.errors import PEER_LOSS, Interrupted, PhalanxError, WorkerError
from phalanx.fileio import atomic_write_text

_interrupted = False  # a worker got SIGINT: it exits quietly (the launcher prints the line)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        sys.exit(2)
    sys.exit(_run_guarded(args.handler, args))


def build_parser() -> argparse.ArgumentParser:
    return build("train PyTorch models on many devices at once", _version())


def _run_guarded(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    in_worker = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if in_worker:
        signal.signal(signal.SIGINT, _on_worker_sigint)
    try:
        return handler(args)
    except Interrupted as e:
        if e.signum == signal.SIGINT:
            print(f"{PROG}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        print(f"{PROG}: {e}", file=sys.stderr)
        return 128 + e.signum
    except (PhalanxError, ValueError) as e:
        if _interrupted:
            return EXIT_INTERRUPTED
        if args.debug:
            raise
        _report(e, in_worker)
        return 1 if isinstance(e, WorkerError) else 2
    except KeyboardInterrupt:
        if not in_worker:
            print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        if _interrupted:  # e.g. a peer that stopped first: part of the interrupt, not an error
            return EXIT_INTERRUPTED
        if args.debug or not in_worker:
            raise
        _report(e, in_worker)
        return 1


def _on_worker_sigint(signum: int, frame: Any) -> None:
    """Ctrl-C reaches every worker through the launcher: stop now, say nothing."""
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def _report(error: BaseException, in_worker: bool) -> None:
    message = str(error) if isinstance(error, PhalanxError) else f"{type(error).__name__}: {error}"
    if in_worker:  # the launcher reads this file to name the rank and the error
        _record_for_launcher(error)
        if any(p in message.lower() for p in PEER_LOSS):  # a consequence: keep it short
            message = "lost its connection to a peer (the launcher names the rank that failed)"
        print(f"{PROG}: rank {os.environ['RANK']}: {message}", file=sys.stderr)
    else:
        print(f"{PROG}: error: {message}", file=sys.stderr)


def _record_for_launcher(error: BaseException) -> None:
    """Write the error file torch elastic's agent reads (``TORCHELASTIC_ERROR_FILE``, the
    format of its ``ErrorHandler.record_exception``), atomically: a worker the launcher stops
    while it writes must not leave half a file, which the agent fails to parse (the launcher
    then died with a JSONDecodeError instead of naming the rank)."""
    import traceback

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": f"{type(error).__name__}: {error}",
            "extraInfo": {
                "py_callstack": traceback.format_exc(),
                "timestamp": str(int(time.time())),
            },
        }
    }
    atomic_write_text(Path(path), json.dumps(data))


def _version() -> str:
    """phalanx's version and the torch it runs on, without importing torch."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"

    return f"{PROG} {__version__} (torch {torch_version})"
