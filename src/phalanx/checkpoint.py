"""Atomic, verified checkpoints: ``RUN_DIR/checkpoints/step-NNNNNNN.pt`` plus ``latest.json``.

A checkpoint is written to a temporary file and renamed into place; ``latest.json`` (also
written atomically) names it with its SHA-256, which is checked before ``torch.load`` (with
``weights_only=True``) reads it. A crash mid-write therefore leaves the previous checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from phalanx.errors import CheckpointError
from phalanx.fields import option, require

LATEST = "latest.json"


@dataclass(kw_only=True)
class CheckpointConfig:
    """When checkpoints are written and how many are kept."""

    every: int = option(0, "write a checkpoint every this many steps (0: only at the end)")
    keep: int = option(2, "how many recent checkpoints to keep (older ones are deleted)")

    def __post_init__(self) -> None:
        require(self.every >= 0, "every", f"must be >= 0, got {self.every}")
        require(self.keep >= 1, "keep", f"must be >= 1, got {self.keep}")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def save(directory: Path, step: int, payload: dict[str, Any], keep: int = 2) -> Path:
    """Write ``payload`` as the checkpoint of ``step`` and point latest.json at it."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    path = directory / f"step-{step:07d}.pt"
    atomic_write_bytes(path, data)
    record = {"file": path.name, "step": step, "sha256": hashlib.sha256(data).hexdigest()}
    atomic_write_text(directory / LATEST, json.dumps(record, indent=2) + "\n")
    _prune(directory, step, keep)
    return path


def _prune(directory: Path, step: int, keep: int) -> None:
    """Keep ``step`` and the keep-1 newest earlier checkpoints; later ones are stale (an old
    run in the same directory) and go too."""
    found = []
    for candidate in directory.glob("step-*.pt"):
        match = re.fullmatch(r"step-(\d+)\.pt", candidate.name)
        if match and int(match.group(1)) != step:
            found.append((int(match.group(1)), candidate))
    earlier = sorted((s, p) for s, p in found if s < step)
    stale = [p for s, p in found if s > step] + [
        p for _, p in earlier[: max(0, len(earlier) - keep + 1)]
    ]
    for old in stale:
        old.unlink(missing_ok=True)


def load(directory: Path) -> dict[str, Any]:
    """The newest checkpoint in ``directory``, verified; CheckpointError if absent or damaged."""
    pointer = directory / LATEST
    if not pointer.is_file():
        raise CheckpointError(f"no checkpoint in {directory} (missing {LATEST})")
    try:
        record = json.loads(pointer.read_text(encoding="utf-8"))
        path = directory / record["file"]
        expected = record["sha256"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{pointer}: unreadable checkpoint pointer ({e})") from None
    if not path.is_file():
        raise CheckpointError(f"{pointer} names {path.name}, which does not exist")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(f"{path}: corrupted checkpoint (SHA-256 does not match {LATEST})")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointError(f"{path}: unreadable checkpoint ({type(e).__name__})") from None
