"""Fault injection for the fault suite and drills: ``PHALANX_FAULT="ACTION@POINT:step=S[:rank=R]
[:attempt=A]"`` and ``PHALANX_FAULT_LOG`` as docs/reliability.md describes; unset, ``fault_at``
costs one list check per point."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from phalanx.errors import ConfigError

ENV = "PHALANX_FAULT"
LOG_ENV = "PHALANX_FAULT_LOG"
ACTIONS = ("kill", "term", "nan")
POINTS = ("forward", "exchange", "checkpoint")


@dataclass(frozen=True)
class Fault:
    action: str
    point: str
    step: int
    rank: int | None = None
    attempt: int = 0


def parse(spec: str) -> list[Fault]:
    """Faults from the variable's value; ConfigError naming the part that is wrong."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        head, *fields = item.split(":")
        action, _, point = head.partition("@")
        if action not in ACTIONS or point not in POINTS:
            raise ConfigError(
                f"{ENV}: {item!r}: expected ACTION@POINT with ACTION in {ACTIONS} and POINT in "
                f"{POINTS}"
            )
        values: dict[str, int] = {}
        for field in fields:
            key, _, value = field.partition("=")
            if key not in ("step", "rank", "attempt") or not value.lstrip("-").isdigit():
                raise ConfigError(f"{ENV}: {item!r}: bad field {field!r} (step=, rank=, attempt=)")
            values[key] = int(value)
        if "step" not in values:
            raise ConfigError(f"{ENV}: {item!r}: missing step=S")
        faults.append(Fault(action, point, **values))
    return faults


_FAULTS: list[Fault] | None = None
_FIRED: set[Fault] = set()  # each fault acts once (a step may pass a point several times)


def _active() -> list[Fault]:
    global _FAULTS
    if _FAULTS is None:
        _FAULTS = parse(os.environ.get(ENV, ""))
    return _FAULTS


def fault_at(point: str, step: int) -> str | None:
    """Perform the fault planned for ``point`` of ``step`` on this rank, if any: ``kill`` and
    ``term`` signal this process; returns the action (so callers can apply ``nan``)."""
    faults = _active()
    if not faults:
        return None
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for fault in faults:
        if (fault.point, fault.step, fault.attempt) != (point, step, attempt):
            continue
        if (fault.rank is not None and fault.rank != rank) or fault in _FIRED:
            continue
        _FIRED.add(fault)
        _log(fault, rank)
        if fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.action == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        return fault.action
    return None


def _log(fault: Fault, rank: int) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{time.time():.3f} {fault.action} {fault.point} {fault.step} {rank}\n")
