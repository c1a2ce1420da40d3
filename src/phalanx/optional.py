"""Optional steps of a run (docs/reliability.md, "Optional steps"): a prediction, a probe, a
build or a writer that cannot do its part falls back to a stated value and says so in one
warning line (what was not done and why, what is used instead, how to do it again); the run
goes on. ``torch_quiet`` holds back torch's own warnings and log lines around phalanx's set-up
steps, so that a one-line error after them stays one line."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import TypeVar

from phalanx.errors import Interrupted, PhalanxError

T = TypeVar("T")
logger = logging.getLogger("phalanx")


def optional(
    run: Callable[[], T],
    fallback: T,
    *,
    what: str,
    instead: str,
    again: str,
    notes: list[str] | None = None,
) -> T:
    """``run()``, or where it raises, ``fallback`` and one warning line: ``what`` (not done),
    the error, ``instead`` (what is used), ``again`` (how to do it again); the line, without its
    ``phalanx: warning:`` prefix, is appended to ``notes`` too. A signal still stops the run."""
    try:
        return run()
    except Interrupted:
        raise
    except Exception as e:  # noqa: BLE001 - whatever failed, the step was optional
        line = f"{what} ({reason(e)}): {instead}; {again}"
        logger.warning("phalanx: warning: %s", line)
        if notes is not None:
            notes.append(line)
        return fallback


def reason(error: BaseException) -> str:
    """An error in one line: its message's last line (a build's log ends with its cause),
    after its type unless it is phalanx's own."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    if isinstance(error, PhalanxError):
        return text or type(error).__name__
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@contextlib.contextmanager
def torch_quiet() -> Iterator[None]:
    """torch's warnings (``warnings``) and log records below ERROR (its ``torch.*`` loggers, as
    a CUDA build of torch without a GPU logs "No CUDA runtime is found") are dropped inside."""
    names = ["torch"] + [n for n in logging.root.manager.loggerDict if n.startswith("torch.")]
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg, level in zip(loggers, levels):
        if lg.name == "torch" or level:  # the rest inherit the "torch" logger's level
            lg.setLevel(max(level, logging.ERROR))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
