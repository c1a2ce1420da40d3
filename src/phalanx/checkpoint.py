"""Checkpoints that survive crashes and corruption, in ``RUN_DIR/checkpoints``.

Each checkpoint is three kinds of file:

- ``step-NNNNNNN.pt``: the payload, written with ``torch.save`` and read back with
  ``torch.load(weights_only=True)``, so a file cannot run code when loaded.
- ``step-NNNNNNN.json``: its integrity record (a "sidecar"), ``{file, step, sha256, bytes}``.
- ``latest.json``: a copy of the newest checkpoint's record, which points at it.

Every file is written to a temporary ``.NAME.*.tmp``, fsynced, renamed into place, and then the
directory is fsynced. The order is fixed: the .pt, then its sidecar, then latest.json. A crash at
any point therefore leaves complete checkpoints, plus perhaps a stray temporary file or a .pt
without a sidecar. Neither is ever loaded (the second is an interrupted write), and the next
``save`` deletes both.

``load`` tries latest.json's checkpoint first, then the others newest first. Each is checked
against its own record: size, SHA-256, then ``torch.load``. If it has to fall back past a damaged
checkpoint, it logs one warning naming the damaged file and the one it resumed from. If none is
good, CheckpointError names the directory and what was wrong with the first one it tried.
latest.json also stands in as the record of the file it names when that file has no sidecar
(checkpoints written before sidecars existed).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from phalanx.errors import CheckpointError
from phalanx.faults import fault_at
from phalanx.fields import option, require

LATEST = "latest.json"
_STEP_FILE = re.compile(r"step-(\d+)\.(pt|json)")
_TEMP_PATTERNS = (".step-*.tmp", f".{LATEST}.*.tmp")  # what atomic_write_bytes leaves on a crash

logger = logging.getLogger("phalanx")


@dataclass(kw_only=True)
class CheckpointConfig:
    """When checkpoints are written and how many are kept."""

    every: int = option(0, "write a checkpoint every this many steps (0: only at the end)")
    keep: int = option(2, "how many recent checkpoints to keep (older ones are deleted)")

    def __post_init__(self) -> None:
        require(self.every >= 0, "every", f"must be >= 0, got {self.every}")
        require(self.keep >= 1, "keep", f"must be >= 1, got {self.keep}")


def atomic_write_bytes(path: Path, data: bytes, midway: Callable[[], object] | None = None) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a mix:
    a temporary file in the same directory, fsynced, renamed into place, then the directory
    fsynced so that the rename itself survives a power cut. ``midway`` runs when half the
    bytes are written (the fault suite kills the process there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            view, half = memoryview(data), len(data) // 2  # slices of a view copy nothing
            if midway is not None:
                f.write(view[:half])
                f.flush()
                midway()
                view = view[half:]
            f.write(view)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """``atomic_write_bytes`` for UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def _fsync_dir(directory: Path) -> None:
    """Flush ``directory``'s entries (a rename lives there, not in the file). Best effort: some
    platforms and file systems cannot open or fsync a directory, and the data is already safe."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(directory: Path, step: int, payload: dict[str, Any], keep: int = 2) -> Path:
    """Write ``payload`` as the checkpoint of ``step``, then its sidecar, then latest.json; the
    sidecar comes after the .pt so that a crash never leaves a record for a partial file."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    path = directory / _step_name(step, "pt")
    atomic_write_bytes(path, data, midway=lambda: fault_at("checkpoint", step))
    record = {
        "file": path.name,
        "step": step,
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
    }
    text = json.dumps(record, indent=2) + "\n"
    atomic_write_text(directory / _step_name(step, "json"), text)
    atomic_write_text(directory / LATEST, text)
    _prune(directory, step, keep)
    return path


def _step_name(step: int, suffix: str) -> str:
    return f"step-{step:07d}.{suffix}"


def _step_files(directory: Path) -> dict[int, dict[str, Path]]:
    """``{step: {"pt": path, "json": path}}`` for the step files present (either may be absent)."""
    found: dict[int, dict[str, Path]] = {}
    for path in directory.glob("step-*"):
        match = _STEP_FILE.fullmatch(path.name)
        if match:
            found.setdefault(int(match.group(1)), {})[match.group(2)] = path
    return found


def _prune(directory: Path, step: int, keep: int) -> None:
    """Keep ``step`` and the keep-1 newest earlier checkpoints; later ones are stale (an old run
    in the same directory) and go too, as do sidecars without a .pt and stray temporary files
    (left by a crash mid-write)."""
    files = _step_files(directory)
    earlier = sorted(s for s, kinds in files.items() if s < step and "pt" in kinds)
    kept = {step, *earlier[max(0, len(earlier) - keep + 1) :]}
    for old in sorted(set(files) - kept):
        for suffix in ("json", "pt"):  # sidecar first: a .pt without one is never loaded
            if suffix in files[old]:
                files[old][suffix].unlink(missing_ok=True)
    for pattern in _TEMP_PATTERNS:
        for stray in directory.glob(pattern):
            stray.unlink(missing_ok=True)


@dataclass(frozen=True)
class _Candidate:
    """A checkpoint ``load`` may try: its .pt and the file holding its integrity record."""

    step: int
    path: Path
    record: Path


class _Damaged(Exception):
    """One checkpoint is unusable; the message says why, worded to follow its file name."""


def _pointed_step(directory: Path) -> int | None:
    """The step latest.json names, or None if it is missing or garbled (the sidecars suffice)."""
    try:
        record = json.loads((directory / LATEST).read_text(encoding="utf-8"))
        match = _STEP_FILE.fullmatch(record["file"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return int(match.group(1)) if match and match.group(2) == "pt" else None


def _candidates(directory: Path) -> list[_Candidate]:
    """Checkpoints in the order ``load`` tries them: latest.json's first, then the others newest
    first. Only steps with a record count: a .pt without one is an interrupted write."""
    files = _step_files(directory)
    pointed = _pointed_step(directory)
    steps = sorted((s for s, kinds in files.items() if "json" in kinds), reverse=True)
    if pointed is not None:
        steps = [pointed] + [s for s in steps if s != pointed]
    return [
        _Candidate(
            step=s,
            path=directory / _step_name(s, "pt"),
            record=files.get(s, {}).get("json", directory / LATEST),
        )
        for s in steps
    ]


def _read_record(candidate: _Candidate) -> dict[str, Any]:
    """The integrity record of ``candidate``, checked to describe its file."""
    try:
        record = json.loads(candidate.record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        record = None
    if (
        isinstance(record, dict)
        and record.get("file") == candidate.path.name
        and isinstance(record.get("sha256"), str)
        and isinstance(record.get("bytes", 0), int)
    ):
        return record
    raise _Damaged(f"has an unreadable integrity record ({candidate.record.name})")


def _load_one(candidate: _Candidate) -> dict[str, Any]:
    """``candidate``'s payload, after checking size and SHA-256 against its record (cheap, and
    specific about what is wrong) and before trusting ``torch.load`` with the bytes."""
    record = _read_record(candidate)
    try:
        data = candidate.path.read_bytes()
    except FileNotFoundError:
        raise _Damaged("does not exist") from None
    except OSError as e:
        raise _Damaged(f"is unreadable ({e.strerror})") from None
    expected = record.get("bytes", len(data))
    if len(data) < expected:
        raise _Damaged(f"is corrupted (truncated to {len(data)} of {expected} bytes)")
    if len(data) != expected:
        raise _Damaged(f"is corrupted ({len(data)} bytes, expected {expected})")
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise _Damaged("is corrupted (SHA-256 mismatch)")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise _Damaged(f"is unreadable ({type(e).__name__})") from None


def load(directory: Path, warn: bool = True) -> dict[str, Any]:
    """The newest good checkpoint in ``directory``. Falling back past damaged ones (with one
    warning, unless ``warn`` is False: every rank loads, one says it) lets a run resume after a
    crash or bit rot instead of stopping; CheckpointError only when there is no good checkpoint
    at all."""
    candidates = _candidates(directory)
    if not candidates:
        raise CheckpointError(f"no checkpoint in {directory}{_orphans_note(directory)}")
    first: tuple[Path, str] | None = None
    for candidate in candidates:
        try:
            payload = _load_one(candidate)
        except _Damaged as e:
            first = first or (candidate.path, str(e))
            continue
        if first is not None:
            if warn:
                logger.warning(
                    "phalanx: checkpoint %s %s; resuming from %s",
                    first[0],
                    first[1],
                    candidate.path.name,
                )
        return payload
    assert first is not None
    others = len(candidates) - 1
    also = f" ({others} other checkpoint{'s' * (others > 1)} also bad)" if others else ""
    raise CheckpointError(f"no good checkpoint in {directory}: {first[0]} {first[1]}{also}")


def _orphans_note(directory: Path) -> str:
    """Why a directory with .pt files has no checkpoint: they were never completed."""
    orphans = sorted(k["pt"].name for k in _step_files(directory).values() if "pt" in k)
    if not orphans:
        return ""
    return f" ({', '.join(orphans)}: no integrity record, an interrupted write)"


def latest_step(directory: Path) -> int | None:
    """The step ``load`` would try first, without reading it, so that a restart can decide
    cheaply whether to resume; None when there is no complete-looking checkpoint."""
    for candidate in _candidates(directory):
        if candidate.path.is_file():
            return candidate.step
    return None
