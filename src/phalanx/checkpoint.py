"""Checkpoints that survive crashes and corruption, written with torch.distributed.checkpoint:
``step-NNNNNNN/``, its integrity record ``step-NNNNNNN.json`` and ``latest.json``;
docs/reliability.md has the layout, the save order and the fall-back past damaged ones.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import io
import json
import logging
import os
import re
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.errors import CheckpointError
from phalanx.fields import option, require
from phalanx.fileio import atomic_write_text, fsync_dir
from phalanx.slices import LazySlices, Slices, _boxes, _flat_offset  # noqa: F401 (re-exported)

LATEST = "latest.json"
METADATA = ".metadata"  # DCP's index of the directory, written by rank 0 last
_STEP_ENTRY = re.compile(r"step-(\d+)(\.pt|\.json)?")
_TEMP_PATTERNS = (".step-*.tmp", f".{LATEST}.*.tmp")  # what a crash mid-write leaves behind

logger = logging.getLogger("phalanx")


def _d() -> Any:
    """torch.distributed.checkpoint and phalanx's planners, imported on first use (importing
    DCP takes most of a second; many commands never write a checkpoint)."""
    from phalanx import _dcp

    return _dcp


def __getattr__(name: str) -> Any:
    if name in ("SavePlanner", "LoadPlanner"):  # DCP planners that know Slices
        return getattr(_d(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(kw_only=True)
class CheckpointConfig:
    """When checkpoints are written and how many are kept."""

    every: int = option(0, "write a checkpoint every this many steps (0: only at the end)")
    keep: int = option(2, "how many recent checkpoints to keep (older ones are deleted)")
    async_save: bool = option(
        False,
        "write checkpoints on a background thread while training continues (the state is "
        "copied to host memory first; the run's last checkpoint is always written in place)",
    )

    def __post_init__(self) -> None:
        require(self.every >= 0, "every", f"must be >= 0, got {self.every}")
        require(self.keep >= 1, "keep", f"must be >= 1, got {self.keep}")


def template(stored: Any) -> Any:
    """Room to load the stored structure ``stored`` (from ``restore``) into: empty tensors for
    tensors, None for other values (DCP replaces them)."""
    return _d().template(stored)


# -- saving ---------------------------------------------------------------------------------------
def _step_name(step: int, suffix: str = "") -> str:
    return f"step-{step:07d}{suffix}"


def _states(state: Mapping[str, Any]) -> dict[str, Any]:
    """What DCP saves: each Stateful's ``state_dict()``, other values as they are."""
    _check_state_argument(state)
    return {k: v.state_dict() if _is_stateful(v) else v for k, v in state.items()}


def _check_state_argument(state: Any) -> None:
    if not isinstance(state, Mapping):
        raise CheckpointError(
            "state: pass a dict of name -> object with state_dict() and load_state_dict() (e.g. "
            f"{{'engine': engine}}); got {type(state).__name__}"
        )


def _is_stateful(value: Any) -> bool:
    return all(callable(getattr(value, m, None)) for m in ("state_dict", "load_state_dict"))


def _distributed(group: Any) -> tuple[bool, Any, int]:
    """(whether a process group is in use, the group, this rank in it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False, None, 0
    group = group if group is not None else dist.group.WORLD
    return True, group, dist.get_rank(group)


def _dcp_kwargs(function: Callable, distributed: bool, group: Any) -> dict[str, Any]:
    """The process group, or ``no_dist`` where this torch has it (2.4 infers it)."""
    if distributed:
        return {"process_group": group}
    return {"no_dist": True} if "no_dist" in inspect.signature(function).parameters else {}


@contextlib.contextmanager
def _quiet_single_process(distributed: bool) -> Iterator[None]:
    """DCP warns that it assumes one process when there is no group: that is the intent."""
    if distributed:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*", category=UserWarning)
        yield


def _digest(path: Path) -> dict[str, Any]:
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            sha.update(block)
            size += len(block)
    return {"sha256": sha.hexdigest(), "bytes": size}


def _complete(directory: Path, step: int, files: dict[str, dict[str, Any]], keep: int) -> Path:
    """Rank 0, once every rank has written: rename the directory into place, then the sidecar,
    then latest.json, then prune."""
    name = _step_name(step)
    tmp, final, sidecar = directory / f".{name}.tmp", directory / name, directory / f"{name}.json"
    files = {**files, METADATA: _digest(tmp / METADATA)}
    total = sum(entry["bytes"] for entry in files.values())
    record = {"dir": name, "step": step, "files": dict(sorted(files.items())), "bytes": total}
    if final.exists():  # a stale checkpoint of this step (an earlier run): its record goes first
        sidecar.unlink(missing_ok=True)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(directory)
    text = json.dumps(record, indent=2) + "\n"
    atomic_write_text(sidecar, text)
    atomic_write_text(directory / LATEST, text)
    _prune(directory, step, keep)
    return final


def _save(
    directory: Path, step: int, states: dict[str, Any], keep: int, group: Any, barrier: bool
) -> Path:
    distributed, group, rank = _distributed(group)
    tmp = directory / f".{_step_name(step)}.tmp"
    if rank == 0:  # a crashed save of this step
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    if distributed:  # DCP's writers create tmp before its first collective: after rank 0's rmtree
        dist.barrier(group=group)
    writer = _d().Writer(tmp, step)
    _write(states, writer, distributed, group)
    files = {name: _digest(tmp / name) for name in writer.written}  # each rank its own files
    if distributed:
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, files, group=group)
        files = {name: entry for part in everyone for name, entry in part.items()}
    path = _complete(directory, step, files, keep) if rank == 0 else directory / _step_name(step)
    if distributed and barrier:
        dist.barrier(group=group)  # the checkpoint is complete when save returns, on every rank
    return path


def _write(states: dict[str, Any], writer: Any, distributed: bool, group: Any) -> None:
    """``dcp.save``; a value the planner refuses (on any rank: DCP raises on every rank)
    comes out as its one-line CheckpointError."""
    d = _d()
    try:
        with _quiet_single_process(distributed):
            d.dcp.save(
                states,
                storage_writer=writer,
                planner=d.SavePlanner(),
                **_dcp_kwargs(d.dcp.save, distributed, group),
            )
    except d.CheckpointException as e:
        first = _first_failure(e)
        if first is None or not isinstance(first[1], CheckpointError):
            raise
        raise CheckpointError(str(first[1])) from None


def save(
    directory: Path, step: int, state: Mapping[str, Any], keep: int = 2, group: Any = None
) -> Path:
    """Write ``state`` as the checkpoint of ``step`` (every rank of ``group`` its part); its
    directory once complete. A value ``weights_only`` loading would refuse is refused first."""
    _check_keep(keep)
    return _save(Path(directory), step, _states(state), keep, group, barrier=True)


def _check_keep(keep: Any) -> None:
    """Before any rank writes (a process group passed fourth lands here, not in ``group``)."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        got = keep if isinstance(keep, int) else type(keep).__name__
        raise CheckpointError(
            f"keep: how many checkpoints to keep, an int >= 1; got {got} (pass a process "
            "group as group=...)"
        )


class PendingSave:
    """A checkpoint being written on a background thread; ``wait()`` for it (re-raises what
    went wrong)."""

    def __init__(self, run: Callable[[], Path]) -> None:
        self.path: Path | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(run,), daemon=True)
        self._thread.name = "phalanx-checkpoint"
        self._thread.start()

    def _run(self, run: Callable[[], Path]) -> None:
        try:
            self.path = run()
        except BaseException as e:  # noqa: BLE001 - re-raised by wait()
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Path:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self.path is not None
        return self.path


def save_async(
    directory: Path, step: int, state: Mapping[str, Any], keep: int = 2, group: Any = None
) -> PendingSave:
    """``save`` on a background thread, of a host copy taken now; ``group`` must be used by
    nothing else meanwhile (its collectives run on the thread); one save at a time."""
    _check_keep(keep)
    snapshot = _snapshot(_states(state))
    return PendingSave(lambda: _save(Path(directory), step, snapshot, keep, group, barrier=False))


def _snapshot(value: Any) -> Any:
    """A host-memory copy of a state dict (tensors and Slices copied; other values deep-copied
    as they are: a Counter stays a Counter)."""
    if isinstance(value, (Mapping, list, tuple)) and not _d().holds_tensors(value):
        return copy.deepcopy(value)
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, LazySlices):  # read now: the tier it reads may change meanwhile
        value = value.materialized()
    if isinstance(value, Slices):
        return Slices(value.shape, value.dtype, [(o, _snapshot(t)) for o, t in value.boxes])
    if isinstance(value, Mapping):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_snapshot(v) for v in value)
    return value


# -- which checkpoints exist, and pruning -----------------------------------------------------
def _step_entries(directory: Path) -> dict[int, dict[str, Path]]:
    """``{step: {"dir" | ".pt" | ".json": path}}`` for the step entries present."""
    found: dict[int, dict[str, Path]] = {}
    if not directory.is_dir():
        return found
    for path in directory.glob("step-*"):
        match = _STEP_ENTRY.fullmatch(path.name)
        if match and (match.group(2) or path.is_dir()):
            found.setdefault(int(match.group(1)), {})[match.group(2) or "dir"] = path
    return found


def _has_payload(kinds: Mapping[str, Path]) -> bool:
    return "dir" in kinds or ".pt" in kinds


def _prune(directory: Path, step: int, keep: int) -> None:
    """Keep ``step`` and the keep-1 newest earlier checkpoints; later ones (stale), orphan
    sidecars and temporary files go."""
    entries = _step_entries(directory)
    earlier = sorted(s for s, kinds in entries.items() if s < step and _has_payload(kinds))
    kept = {step, *earlier[max(0, len(earlier) - keep + 1) :]}
    for old in sorted(set(entries) - kept):
        for kind in (".json", ".pt", "dir"):  # the record first: what it names is never loaded
            path = entries[old].get(kind)
            if path is not None:
                _remove(path)
    for pattern in _TEMP_PATTERNS:
        for stray in directory.glob(pattern):
            _remove(stray)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# -- choosing and loading -----------------------------------------------------------------------
@dataclass(frozen=True)
class _Candidate:
    """A checkpoint ``choose`` may try: its step and the file holding its integrity record."""

    step: int
    record: Path


class _Damaged(Exception):
    """One checkpoint is unusable; the message says why, worded to follow its name."""


@dataclass(frozen=True)
class Found:
    """The checkpoint ``choose`` picked: its step and directory (or ``.pt`` file, ``legacy``)."""

    step: int
    path: Path
    legacy: bool = False


def _record_target(record: Any) -> str | None:
    if not isinstance(record, dict):
        return None
    target = record.get("dir", record.get("file"))
    return target if isinstance(target, str) else None


def _pointed_step(directory: Path) -> int | None:
    """The step latest.json names, or None if it is missing or garbled (the sidecars suffice)."""
    try:
        target = _record_target(json.loads((directory / LATEST).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None
    match = _STEP_ENTRY.fullmatch(target or "")
    return int(match.group(1)) if match and match.group(2) in (None, ".pt") else None


def _candidates(directory: Path) -> list[_Candidate]:
    """Checkpoints with a record, in ``choose``'s order: latest.json's first, then newest first
    (latest.json is the record of a pre-sidecar ``.pt``)."""
    entries = _step_entries(directory)
    pointed = _pointed_step(directory)
    steps = sorted((s for s, kinds in entries.items() if ".json" in kinds), reverse=True)
    if pointed is not None:
        steps = [pointed] + [s for s in steps if s != pointed]
    return [_Candidate(s, entries.get(s, {}).get(".json", directory / LATEST)) for s in steps]


def _path_of(candidate: _Candidate, record: Any) -> Path:
    """The checkpoint a record describes (its directory, or a legacy .pt)."""
    directory = candidate.record.parent
    match = _STEP_ENTRY.fullmatch(_record_target(record) or "")
    if match and int(match.group(1)) == candidate.step and match.group(2) in (None, ".pt"):
        return directory / match.group(0)
    legacy = directory / _step_name(candidate.step, ".pt")
    return legacy if legacy.exists() else directory / _step_name(candidate.step)


def _read_record(candidate: _Candidate) -> tuple[Path, dict[str, Any]]:
    """The checkpoint ``candidate`` names and its integrity record, checked to describe it."""
    try:
        record = json.loads(candidate.record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        record = None
    path = _path_of(candidate, record)
    if not isinstance(record, dict) or _record_target(record) != path.name:
        raise _Damaged(path, f"has an unreadable integrity record ({candidate.record.name})")
    if path.suffix == ".pt":
        if isinstance(record.get("sha256"), str) and isinstance(record.get("bytes", 0), int):
            return path, record
    elif isinstance(record.get("files"), dict) and all(
        isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("bytes"), int)
        for e in record["files"].values()
    ):
        return path, record
    raise _Damaged(path, f"has an unreadable integrity record ({candidate.record.name})")


def _check_bytes(data_len: int, expected: int, sha: str, expected_sha: str, what: str) -> None:
    if data_len < expected:
        raise _Damaged(None, f"is corrupted ({what}truncated to {data_len} of {expected} bytes)")
    if data_len != expected:
        raise _Damaged(None, f"is corrupted ({what}{data_len} bytes, expected {expected})")
    if sha != expected_sha:
        raise _Damaged(None, f"is corrupted ({what}SHA-256 mismatch)")


def _verify(candidate: _Candidate) -> tuple[Found, Any]:
    """Check ``candidate`` against its record; returns it and, for a legacy .pt, its payload."""
    path, record = _read_record(candidate)
    try:
        if path.suffix == ".pt":
            return Found(candidate.step, path, legacy=True), _verify_pt(path, record)
        _verify_dir(path, record)
        return Found(candidate.step, path), None
    except _Damaged as e:
        raise _Damaged(path, e.args[1]) from None


def _verify_pt(path: Path, record: dict[str, Any]) -> Any:
    """A legacy checkpoint's payload, after checking size and SHA-256 (cheap, and specific
    about what is wrong) and before trusting ``torch.load`` with the bytes."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise _Damaged(path, "does not exist") from None
    except OSError as e:
        raise _Damaged(path, f"is unreadable ({e.strerror})") from None
    sha = hashlib.sha256(data).hexdigest()
    _check_bytes(len(data), record.get("bytes", len(data)), sha, record["sha256"], "")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise _Damaged(path, f"is unreadable ({type(e).__name__})") from None


def _verify_dir(path: Path, record: dict[str, Any]) -> None:
    """Every file the record lists, by size and SHA-256; then DCP's metadata must load."""
    if not path.is_dir():
        raise _Damaged(path, "does not exist")
    files = record["files"]
    if METADATA not in files:
        raise _Damaged(path, f"has an unreadable integrity record (no {METADATA})")
    for name, entry in sorted(files.items()):
        try:
            digest = _digest(path / name)
        except FileNotFoundError:
            raise _Damaged(path, f"is incomplete ({name} is missing)") from None
        except OSError as e:
            raise _Damaged(path, f"is unreadable ({name}: {e.strerror})") from None
        _check_bytes(digest["bytes"], entry["bytes"], digest["sha256"], entry["sha256"], f"{name} ")
    try:
        _d().dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - whatever it is, the checkpoint cannot be read
        raise _Damaged(path, f"is unreadable ({METADATA}: {type(e).__name__})") from None


def _choose(directory: Path, warn: bool) -> tuple[Found, Any]:
    if not directory.exists():  # a mistyped run directory, say: not the same as an empty one
        raise CheckpointError(f"no checkpoint in {directory}: no such directory")
    candidates = _candidates(directory)
    if not candidates:
        raise CheckpointError(f"no checkpoint in {directory}{_orphans_note(directory)}")
    first: tuple[Path, str] | None = None
    for candidate in candidates:
        try:
            found, payload = _verify(candidate)
        except _Damaged as e:
            first = first or (e.args[0], e.args[1])
            continue
        if first is not None and warn:
            logger.warning(
                "phalanx: checkpoint %s %s; resuming from %s", first[0], first[1], found.path.name
            )
        return found, payload
    assert first is not None
    others = len(candidates) - 1
    also = f" ({others} other checkpoint{'s' * (others > 1)} also bad)" if others else ""
    raise CheckpointError(f"no good checkpoint in {directory}: {first[0]} {first[1]}{also}")


def choose(directory: Path, warn: bool = True) -> Found:
    """The newest good checkpoint in ``directory``, verified but not loaded, past damaged ones
    (one warning unless ``warn`` is False); CheckpointError when there is none."""
    return _choose(Path(directory), warn)[0]


def _orphans_note(directory: Path) -> str:
    """Why a directory with checkpoint payloads has no checkpoint: they were never completed."""
    entries = _step_entries(directory).values()
    orphans = sorted(p.name for kinds in entries for k, p in kinds.items() if k in ("dir", ".pt"))
    if not orphans:
        return ""
    return f" ({', '.join(orphans)}: no integrity record, an interrupted write)"


def latest_step(directory: Path) -> int | None:
    """The step ``choose`` would try first, without reading it, so that a restart can decide
    cheaply whether to resume; None when there is no complete-looking checkpoint."""
    directory = Path(directory)
    for candidate in _candidates(directory):
        try:
            record = json.loads(candidate.record.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            record = None
        if _path_of(candidate, record).exists():
            return candidate.step
    return None


def stored_structure(path: Path) -> dict[str, Any]:
    """The nested structure a DCP checkpoint directory holds, its leaves DCP's storage
    metadata (TensorStorageMetadata: shape, dtype and chunks; BytesStorageMetadata)."""
    d = _d()
    return d.structure(d.dcp.FileSystemReader(str(path)).read_metadata())


class _Prepared:
    """A Stateful object about to be loaded: its ``state_dict(stored=...)`` (when it takes
    ``stored``) describes what this rank reads from the checkpoint's structure."""

    def __init__(self, obj: Any, stored: Any) -> None:
        self.obj, self.stored = obj, stored

    def state_dict(self) -> Any:
        if "stored" in inspect.signature(self.obj.state_dict).parameters:
            return self.obj.state_dict(stored=self.stored if self.stored is not None else {})
        return self.obj.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.obj.load_state_dict(state)


def restore(
    directory: Path,
    state: dict[str, Any],
    group: Any = None,
    warn: bool = True,
    legacy: Callable[[dict[str, Any]], None] | None = None,
) -> Found:
    """Load the newest good checkpoint into ``state`` (Stateful objects in place, other values
    replaced) on every rank of ``group``, as rank 0 chose; a legacy ``.pt`` goes to ``legacy``."""
    _check_state_argument(state)
    directory = Path(directory)
    distributed, group, rank = _distributed(group)
    found: Found | None = None
    payload, error = None, None
    if rank == 0:
        try:
            found, payload = _choose(directory, warn)
        except CheckpointError as e:
            error = str(e)
    if distributed:
        box: list[Any] = [found, error]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        found, error = box
    if error is not None:
        raise CheckpointError(error)
    assert found is not None
    if found.legacy:
        if legacy is None:
            raise CheckpointError(f"{found.path}: a single-file checkpoint; load() reads it")
        legacy(payload if payload is not None else _verify_pt_unchecked(found.path))
        return found
    try:
        stored = stored_structure(found.path)
        prepared = {
            k: _Prepared(v, stored.get(k)) if _is_stateful(v) else v for k, v in state.items()
        }
        _dcp_load(prepared, found.path, distributed, group)
    except CheckpointError:
        raise
    except BaseException as e:
        raise _load_error(found.path, e) from e
    for key, value in prepared.items():
        if not isinstance(value, _Prepared):
            state[key] = value
    return found


def _verify_pt_unchecked(path: Path) -> Any:
    """A legacy payload rank 0 has verified: the other ranks only read it."""
    return torch.load(path, map_location="cpu", weights_only=True)


def _dcp_load(state: Any, path: Path, distributed: bool, group: Any) -> None:
    d = _d()
    reader = d.dcp.FileSystemReader(str(path))
    with _quiet_single_process(distributed):
        kwargs = _dcp_kwargs(d.dcp.load, distributed, group)
        d.dcp.load(state, storage_reader=reader, planner=d.LoadPlanner(), **kwargs)


def _load_error(path: Path, error: BaseException) -> CheckpointError:
    """The one-line error for a checkpoint that cannot be loaded (DCP's CheckpointException
    is a BaseException); anything else (KeyboardInterrupt, SystemExit) is re-raised as it is."""
    if not isinstance(error, (Exception, _d().CheckpointException)):
        raise error
    return CheckpointError(f"cannot load {path}: {_one_line(error)}")


def _first_failure(error: BaseException) -> tuple[int, BaseException] | None:
    """DCP's error's first failing rank and its error (DCP raises one error for all ranks')."""
    if not isinstance(error, _d().CheckpointException) or not error.failures:
        return None
    rank, (cause, _) = min(error.failures.items(), key=lambda item: item[0])
    return rank, cause


def _one_line(error: BaseException) -> str:
    """What went wrong, in one line (DCP's first failing rank's error)."""
    first = _first_failure(error)
    if first is not None:
        return f"rank {first[0]}: {_one_line(first[1])}"
    text = f"{type(error).__name__}: {' '.join(str(error).split())}".rstrip(": ")
    return text if len(text) <= 300 else text[:297] + "..."


def load(directory: Path, warn: bool = True, only: Sequence[str] | None = None) -> dict[str, Any]:
    """The newest good checkpoint's whole state as nested dicts of CPU tensors, in this process
    (e.g. ``load(d)["trainer"]["step"]``); ``only``: dotted prefixes to read."""
    found, payload = _choose(Path(directory), warn)
    if found.legacy:
        return payload
    d = _d()
    metadata = d.dcp.FileSystemReader(str(found.path)).read_metadata()
    mappings = metadata.planner_data or {}
    state: dict[str, Any] = {}
    for key, stored in metadata.state_dict_metadata.items():
        if only is None or any(key == p or key.startswith(p + ".") for p in only):
            d.set_element(state, mappings.get(key, (key,)), template(stored))
    try:
        _dcp_load(state, found.path, False, None)
    except BaseException as e:
        raise _load_error(found.path, e) from e
    return state


# -- optimizer state in per-parameter form --------------------------------------------------------
def optimizer_to_dcp(
    state: dict[int, dict[str, Any]],
    groups: list[dict[str, Any]],
    params: list[torch.nn.Parameter],
    names: list[str],
) -> dict[str, Any]:
    """A strategy's ``optimizer_shards`` by parameter name for DCP: per-element state in the
    parameter's shape (a tensor, or ``Slices`` where this rank holds part), groups by name."""
    out = {names[i]: {k: _to_dcp(v, params[i]) for k, v in e.items()} for i, e in state.items()}
    hyper = tuple({**g, "params": [names[i] for i in g["params"]]} for g in groups)
    return {"state": out, "param_groups": hyper}


def _to_dcp(value: Any, p: torch.Tensor) -> Any:
    if not isinstance(value, list):
        return value  # a counter, or Slices already (LazySlices: read as they are written)
    if len(value) == 1 and value[0][0] == 0 and value[0][1].numel() == p.numel():
        return value[0][1].view(p.shape)
    return Slices.from_flat(p.shape, value)


def optimizer_template(
    stored: Any,
    ranges: dict[int, list[tuple[int, int]]],
    params: list[torch.nn.Parameter],
    names: list[str],
) -> dict[str, Any]:
    """Room for the optimizer state a rank needs from a checkpoint's ``stored`` structure: the
    flat ``ranges`` of each parameter it keeps state for, and its other values."""
    stored = stored if isinstance(stored, Mapping) else {}
    on_disk = stored.get("state", {})
    out: dict[str, Any] = {}
    for i, p in enumerate(params):
        own, entry = ranges.get(i), on_disk.get(names[i])
        if not own or not isinstance(entry, Mapping):
            continue
        room: dict[str, Any] = {}
        for key, md in entry.items():
            if not isinstance(md, _d().TensorStorageMetadata):
                room[key] = None
            elif len(md.size) > 0 and tuple(md.size) == tuple(p.shape):
                if own == [(0, p.numel())]:
                    room[key] = torch.empty(md.size, dtype=md.properties.dtype)
                else:
                    room[key] = Slices.empty(p.shape, md.properties.dtype, own)
            else:
                room[key] = torch.empty(md.size, dtype=md.properties.dtype)
        out[names[i]] = room
    return {"state": out, **({"param_groups": None} if "param_groups" in stored else {})}


def optimizer_from_dcp(
    state: Mapping[str, Any], params: list[torch.nn.Parameter], names: list[str]
) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """What ``optimizer_to_dcp`` or ``optimizer_template`` hold, after a load, back in the
    strategies' form: ``({param index: {key: pieces or value}}, groups)``."""
    index = {name: i for i, name in enumerate(names)}
    out: dict[int, dict[str, Any]] = {}
    for name, entry in (state.get("state") or {}).items():
        i = index.get(name)
        if i is None:
            raise CheckpointError(f"checkpoint has optimizer state for {name!r}, not a parameter")
        out[i] = {key: _from_dcp(value, params[i]) for key, value in entry.items()}
    groups = [
        {**g, "params": [index[n] for n in g.get("params", ()) if n in index]}
        for g in (state.get("param_groups") or ())
    ]
    return out, groups


def _from_dcp(value: Any, p: torch.Tensor) -> Any:
    if isinstance(value, Slices):
        return value.flat_pieces()
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.shape:
        return [(0, value.reshape(-1))]
    return value
