"""Files written atomically (readers see the old file or the new one, never a mix): every file
phalanx writes for later reading goes through here."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "PHALANX_CACHE_DIR"
# The process's umask, read once at import (reading it means setting it): a written file gets
# the mode open() would give it, 0o666 less the umask, not mkstemp's private 0o600.
_UMASK = os.umask(0o022)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK


def cache_dir() -> Path:
    """Where phalanx keeps what it measured or built for a machine: ``$PHALANX_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/phalanx``, else ``~/.cache/phalanx``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "phalanx"


def atomic_write_bytes(path: Path, data: bytes, midway: Callable[[], object] | None = None) -> None:
    """A fsynced temporary file renamed into place, then the directory fsynced (the rename
    survives a power cut); ``midway`` runs half-way (the fault suite kills there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, FILE_MODE)  # readable by whom any file the user writes is
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
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """``atomic_write_bytes`` for UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def fsync_dir(directory: Path) -> None:
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
