"""Checkpoints (torch.distributed.checkpoint directories, here written by one process):
sidecars and latest.json, pruning, verification of every file on load, falling back past
damaged checkpoints, background saves, pieces of shared tensors, and the single-file
checkpoints of earlier versions."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import stat
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from phalanx import _dcp, checkpoint
from phalanx.checkpoint import LATEST, Slices, _boxes
from phalanx.errors import CheckpointError, ConfigError
from phalanx.fileio import atomic_write_bytes, atomic_write_text

SHARD = "__0_0.distcp"  # the shard file of rank 0 (the only rank here)


class NotWeights:
    """An arbitrary object: ``weights_only=True`` loading must refuse to unpickle it."""

    def __init__(self) -> None:
        self.value = 1


def payload(step: int) -> dict:
    return {
        "step": step,
        "engine": {"model": {"w": torch.full((3, 2), float(step))}, "num_steps": step},
        "data": {"epoch": 0, "step": step},
        "rng": [{"cpu": torch.get_rng_state()}],
        "name": "tiny",
    }


def load_error(directory: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(directory)
    message = str(info.value)
    assert message and "\n" not in message, f"not a single line: {message!r}"
    return message


def pointer(directory: Path) -> dict:
    return json.loads((directory / LATEST).read_text())


def ckpt(directory: Path, step: int) -> Path:
    return directory / f"step-{step:07d}"


def sidecar(directory: Path, step: int) -> Path:
    return directory / f"step-{step:07d}.json"


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def torch_bytes(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def write_single_file(directory: Path, step: int, data: bytes, pointer_only: bool = False) -> Path:
    """A checkpoint in the single-file format of earlier versions: step-N.pt and its record."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{step:07d}.pt"
    path.write_bytes(data)
    record = {
        "file": path.name,
        "step": step,
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
    }
    if not pointer_only:
        sidecar(directory, step).write_text(json.dumps(record))
    (directory / LATEST).write_text(json.dumps(record))
    return path


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "phalanx" and r.levelno >= logging.WARNING
    ]


def test_round_trip(tmp_path):
    original = payload(7)
    path = checkpoint.save(tmp_path, 7, original)
    assert path == ckpt(tmp_path, 7)
    assert sorted(p.name for p in path.iterdir()) == [".metadata", SHARD]
    loaded = checkpoint.load(tmp_path)
    assert loaded.keys() == original.keys()
    assert torch.equal(loaded["engine"]["model"]["w"], original["engine"]["model"]["w"])
    assert loaded["engine"]["num_steps"] == 7
    assert loaded["data"] == {"epoch": 0, "step": 7}
    assert torch.equal(loaded["rng"][0]["cpu"], original["rng"][0]["cpu"])
    assert loaded["name"] == "tiny"
    only = checkpoint.load(tmp_path, only=("engine.model", "step"))
    assert only.keys() == {"engine", "step"} and only["engine"].keys() == {"model"}


def test_latest_and_sidecar_record_every_file_with_its_hash_and_size(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, payload(step), keep=5)
    record = pointer(tmp_path)
    assert record["dir"] == "step-0000003" and record["step"] == 3
    assert set(record["files"]) == {".metadata", SHARD}
    for name, entry in record["files"].items():
        data = (ckpt(tmp_path, 3) / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert record["bytes"] == sum(e["bytes"] for e in record["files"].values())
    for step in (1, 2, 3):
        own = json.loads(sidecar(tmp_path, step).read_text())
        assert own["dir"] == ckpt(tmp_path, step).name and own["step"] == step
    assert json.loads(sidecar(tmp_path, 3).read_text()) == record
    assert checkpoint.load(tmp_path)["step"] == 3


def test_keep_two_prunes_older_with_their_sidecars(tmp_path):
    for step in (10, 20, 30, 40):
        checkpoint.save(tmp_path, step, payload(step), keep=2)
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert names == ["step-0000030", "step-0000030.json", "step-0000040", "step-0000040.json"]
    assert checkpoint.load(tmp_path)["step"] == 40


def test_save_never_deletes_the_checkpoint_it_just_wrote(tmp_path):
    checkpoint.save(tmp_path, 200, payload(200), keep=1)
    checkpoint.save(tmp_path, 4, payload(4), keep=1)
    assert checkpoint.load(tmp_path)["step"] == 4
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-0000004", "step-0000004.json"]


def test_prune_removes_orphan_sidecars_checkpoints_without_one_and_single_files(tmp_path):
    checkpoint.save(tmp_path, 1, payload(1), keep=5)
    sidecar(tmp_path, 2).write_text("{}")  # its checkpoint is gone
    ckpt(tmp_path, 9).mkdir()  # no sidecar, later than the next save
    write_single_file(tmp_path, 0, torch_bytes(payload(0)))  # older than keep allows
    checkpoint.save(tmp_path, 3, payload(3), keep=2)
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert names == ["step-0000001", "step-0000001.json", "step-0000003", "step-0000003.json"]


def test_saving_a_step_again_replaces_it(tmp_path):
    checkpoint.save(tmp_path, 5, payload(5))
    checkpoint.save(tmp_path, 5, {**payload(5), "name": "again"})
    assert checkpoint.load(tmp_path)["name"] == "again"


# -- one checkpoint, damaged: CheckpointError, one line -------------------------------------------


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (flip_byte, f"is corrupted ({SHARD} SHA-256 mismatch)"),
        (truncate, f"is corrupted ({SHARD} truncated to "),
        (lambda p: p.write_bytes(p.read_bytes() + b"x"), f"is corrupted ({SHARD} "),
        (lambda p: p.unlink(), f"is incomplete ({SHARD} is missing)"),
    ],
)
def test_damaged_shard_file(tmp_path, damage, reason):
    path = checkpoint.save(tmp_path, 5, payload(5))
    damage(path / SHARD)
    message = load_error(tmp_path)
    assert message.startswith(f"no good checkpoint in {tmp_path}: {path} {reason}")
    with pytest.raises(CheckpointError, match="SHA-256|truncated|missing|expected"):
        checkpoint.choose(tmp_path)


def test_damaged_metadata(tmp_path):
    path = checkpoint.save(tmp_path, 5, payload(5))
    flip_byte(path / ".metadata")
    assert "is corrupted (.metadata SHA-256 mismatch)" in load_error(tmp_path)


def test_missing_directory(tmp_path):
    message = load_error(tmp_path / "nowhere")
    assert "no checkpoint" in message and str(tmp_path / "nowhere") in message
    assert checkpoint.latest_step(tmp_path / "nowhere") is None


def test_empty_directory(tmp_path):
    message = load_error(tmp_path)
    assert message == f"no checkpoint in {tmp_path}"
    assert checkpoint.latest_step(tmp_path) is None


def test_checkpoint_named_but_missing(tmp_path):
    path = checkpoint.save(tmp_path, 5, payload(5))
    for f in path.iterdir():
        f.unlink()
    path.rmdir()
    message = load_error(tmp_path)
    assert path.name in message and "does not exist" in message
    assert checkpoint.latest_step(tmp_path) is None


def test_garbled_sidecar(tmp_path):
    checkpoint.save(tmp_path, 5, payload(5))
    (tmp_path / LATEST).unlink()
    sidecar(tmp_path, 5).write_text("{not json")
    message = load_error(tmp_path)
    assert "step-0000005" in message and "integrity record" in message


def test_matching_hashes_but_not_a_checkpoint(tmp_path):
    path = checkpoint.save(tmp_path, 1, payload(1))
    (path / ".metadata").write_bytes(b"this is not DCP metadata")
    record = pointer(tmp_path)
    record["files"][".metadata"] = {
        "sha256": hashlib.sha256(b"this is not DCP metadata").hexdigest(),
        "bytes": 24,
    }
    sidecar(tmp_path, 1).write_text(json.dumps(record))
    message = load_error(tmp_path)
    assert "step-0000001" in message and "is unreadable (.metadata" in message


def test_load_refuses_arbitrary_objects(tmp_path, monkeypatch):
    """Non-tensor values are unpickled with weights_only=True: a class instance (saved by an
    earlier version, which did not refuse it) is refused and never executed, one line naming
    the checkpoint."""
    monkeypatch.setattr(_dcp, "check_loadable", lambda fqn, value: None)
    checkpoint.save(tmp_path, 1, {"obj": NotWeights(), "w": torch.ones(2)})
    message = load_error(tmp_path)
    assert message.startswith(f"cannot load {ckpt(tmp_path, 1)}: ")


@pytest.mark.parametrize("background", [False, True])
def test_save_refuses_what_loading_would_refuse(tmp_path, background):
    """At save time, not at resume hours later: one line naming the key, the type and the fix;
    nothing becomes a checkpoint."""
    state = {"w": torch.ones(2), "run": {"obj": [NotWeights()], "ok": 1}}
    with pytest.raises(CheckpointError) as info:
        if background:
            checkpoint.save_async(tmp_path, 1, state).wait()
        else:
            checkpoint.save(tmp_path, 1, state)
    message = str(info.value)
    assert "\n" not in message and message.startswith("checkpoint: 'run.obj' holds a ")
    assert "NotWeights" in message and "state_dict() and load_state_dict()" in message
    assert checkpoint.latest_step(tmp_path) is None


# -- several checkpoints: fall back past damaged ones ---------------------------------------------


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (flip_byte, f"is corrupted ({SHARD} SHA-256 mismatch)"),
        (truncate, f"is corrupted ({SHARD} truncated to "),
    ],
)
def test_damaged_newest_falls_back_with_one_warning(tmp_path, caplog, damage, reason):
    for step in (10, 20):
        checkpoint.save(tmp_path, step, payload(step))
    damage(ckpt(tmp_path, 20) / SHARD)
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        loaded = checkpoint.load(tmp_path)
    assert loaded["step"] == 10
    assert torch.equal(loaded["engine"]["model"]["w"], payload(10)["engine"]["model"]["w"])
    (message,) = warnings(caplog)
    assert "\n" not in message
    assert message.startswith(f"phalanx: checkpoint {ckpt(tmp_path, 20)} {reason}")
    assert message.endswith("; resuming from step-0000010")
    assert checkpoint.choose(tmp_path, warn=False).step == 10


def test_falls_back_past_several_damaged_with_one_warning(tmp_path, caplog):
    for step in (10, 20, 30):
        checkpoint.save(tmp_path, step, payload(step), keep=3)
    flip_byte(ckpt(tmp_path, 30) / SHARD)
    (ckpt(tmp_path, 20) / ".metadata").unlink()
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        assert checkpoint.load(tmp_path)["step"] == 10
    (message,) = warnings(caplog)
    assert "step-0000030 is corrupted" in message and "resuming from step-0000010" in message


def test_newest_without_sidecar_is_an_interrupted_write_and_never_loaded(tmp_path, caplog):
    """A crash between renaming step 20's directory into place and writing its sidecar:
    latest.json still names step 10, and the complete-looking step 20 is ignored."""
    checkpoint.save(tmp_path, 10, payload(10))
    saved = (tmp_path / LATEST).read_text()
    checkpoint.save(tmp_path, 20, payload(20))
    sidecar(tmp_path, 20).unlink()
    (tmp_path / LATEST).write_text(saved)
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        assert checkpoint.load(tmp_path)["step"] == 10
    assert warnings(caplog) == []
    assert checkpoint.latest_step(tmp_path) == 10


def test_newest_without_sidecar_and_no_pointer_is_not_loaded(tmp_path):
    checkpoint.save(tmp_path, 10, payload(10))
    checkpoint.save(tmp_path, 20, payload(20))
    sidecar(tmp_path, 20).unlink()
    (tmp_path / LATEST).write_text("{not json")
    assert checkpoint.load(tmp_path)["step"] == 10
    assert checkpoint.latest_step(tmp_path) == 10


def test_only_interrupted_writes_is_no_checkpoint(tmp_path):
    checkpoint.save(tmp_path, 1, payload(1))
    sidecar(tmp_path, 1).unlink()
    (tmp_path / LATEST).unlink()
    message = load_error(tmp_path)
    assert message.startswith(f"no checkpoint in {tmp_path}")
    assert "step-0000001" in message and "interrupted write" in message
    assert checkpoint.latest_step(tmp_path) is None


def test_all_damaged_is_one_line_naming_the_directory_and_the_newest(tmp_path):
    for step in (10, 20):
        checkpoint.save(tmp_path, step, payload(step))
    flip_byte(ckpt(tmp_path, 20) / SHARD)
    truncate(ckpt(tmp_path, 10) / SHARD)
    message = load_error(tmp_path)
    assert message.startswith(f"no good checkpoint in {tmp_path}: ")
    assert f"{ckpt(tmp_path, 20)} is corrupted ({SHARD} SHA-256 mismatch)" in message
    assert "1 other checkpoint also bad" in message


# -- latest.json damaged or missing: the sidecars suffice -----------------------------------------


@pytest.mark.parametrize(
    "text", [None, "{not json", "[]", '"x"', '{"dir": 7}', '{"dir": "elsewhere"}']
)
def test_missing_or_garbled_pointer_loads_newest_good(tmp_path, caplog, text):
    for step in (10, 20):
        checkpoint.save(tmp_path, step, payload(step))
    if text is None:
        (tmp_path / LATEST).unlink()
    else:
        (tmp_path / LATEST).write_text(text)
    assert checkpoint.latest_step(tmp_path) == 20
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        assert checkpoint.load(tmp_path)["step"] == 20
    assert warnings(caplog) == []


def test_pointer_is_tried_first(tmp_path):
    """A crash after step 20's sidecar but before latest.json: step 10, which latest.json names,
    is still the one resumed from (and step 20 is the fallback)."""
    checkpoint.save(tmp_path, 10, payload(10))
    saved = (tmp_path / LATEST).read_text()
    checkpoint.save(tmp_path, 20, payload(20))
    (tmp_path / LATEST).write_text(saved)
    assert checkpoint.latest_step(tmp_path) == 10
    assert checkpoint.load(tmp_path)["step"] == 10
    flip_byte(ckpt(tmp_path, 10) / SHARD)
    assert checkpoint.load(tmp_path)["step"] == 20


def test_latest_step_does_not_read_the_checkpoint(tmp_path):
    for step in (10, 20):
        checkpoint.save(tmp_path, step, payload(step))
    flip_byte(ckpt(tmp_path, 20) / SHARD)
    assert checkpoint.latest_step(tmp_path) == 20  # looks complete; load() would fall back


# -- single-file checkpoints of earlier versions --------------------------------------------------


def test_single_file_checkpoint_loads_and_is_verified(tmp_path, caplog):
    path = write_single_file(tmp_path, 5, torch_bytes(payload(5)))
    assert checkpoint.latest_step(tmp_path) == 5
    found = checkpoint.choose(tmp_path)
    assert (found.step, found.path, found.legacy) == (5, path, True)
    assert checkpoint.load(tmp_path)["step"] == 5
    checkpoint.save(tmp_path, 6, payload(6))  # the new format next to it
    flip_byte(ckpt(tmp_path, 6) / SHARD)
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        assert checkpoint.load(tmp_path)["step"] == 5
    (message,) = warnings(caplog)
    assert message.endswith("; resuming from step-0000005.pt")
    flip_byte(path)
    message = load_error(tmp_path)
    assert "step-0000006 is corrupted" in message and "1 other checkpoint also bad" in message
    sidecar(tmp_path, 6).unlink()
    (tmp_path / LATEST).unlink()
    assert f"{path} is corrupted (SHA-256 mismatch)" in load_error(tmp_path)


def test_single_file_checkpoint_from_before_sidecars_loads_by_its_pointer(tmp_path):
    path = write_single_file(tmp_path, 5, torch_bytes(payload(5)), pointer_only=True)
    assert checkpoint.latest_step(tmp_path) == 5
    assert checkpoint.load(tmp_path)["step"] == 5
    truncate(path)
    assert "corrupted (truncated to" in load_error(tmp_path)


def test_single_file_checkpoint_refuses_arbitrary_objects(tmp_path):
    write_single_file(tmp_path, 1, torch_bytes({"obj": NotWeights()}))
    assert "step-0000001.pt is unreadable" in load_error(tmp_path)


# -- temporary files and atomic writes ------------------------------------------------------------


def test_save_leaves_no_temp_files(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, payload(step), keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [LATEST, "step-0000002", "step-0000002.json", "step-0000003",
                     "step-0000003.json"]  # fmt: skip


def test_stray_temp_files_are_ignored_and_cleaned_by_the_next_save(tmp_path):
    checkpoint.save(tmp_path, 1, payload(1))
    (tmp_path / ".step-0000002.tmp").mkdir()
    (tmp_path / ".step-0000002.tmp" / SHARD).write_bytes(b"partial")
    (tmp_path / f".{LATEST}.ghi789.tmp").write_bytes(b"partial")
    assert checkpoint.load(tmp_path)["step"] == 1
    assert checkpoint.latest_step(tmp_path) == 1
    checkpoint.save(tmp_path, 2, payload(2))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_save_fsyncs_the_directory(tmp_path, monkeypatch):
    directories = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            directories.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    checkpoint.save(tmp_path, 1, payload(1))
    assert len(directories) == 3  # after each rename: the directory, sidecar, latest.json


def test_directory_fsync_failure_is_ignored(tmp_path, monkeypatch):
    real_open = os.open

    def no_directories(path: object, flags: int, *args: object) -> int:
        if Path(path).is_dir():  # type: ignore[arg-type]
            raise OSError("cannot open a directory here")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_directories)
    checkpoint.save(tmp_path, 1, payload(1))
    assert checkpoint.load(tmp_path)["step"] == 1


def test_atomic_write_creates_parents_overwrites_and_leaves_no_temp(tmp_path):
    target = tmp_path / "a" / "b" / "file.bin"
    atomic_write_bytes(target, b"first")
    atomic_write_bytes(target, b"second")
    assert target.read_bytes() == b"second"
    assert [p.name for p in target.parent.iterdir()] == ["file.bin"]
    atomic_write_text(tmp_path / "t.txt", "h\u00e9\n")
    assert (tmp_path / "t.txt").read_bytes() == "h\u00e9\n".encode()
    (tmp_path / "plain.txt").write_text("x")  # the mode any file the user writes gets
    plain_mode = (tmp_path / "plain.txt").stat().st_mode & 0o777
    assert target.stat().st_mode & 0o777 == plain_mode  # not mkstemp's private 0o600


def test_atomic_write_failure_keeps_old_content_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "file.bin"
    atomic_write_bytes(target, b"old")

    def broken_fsync(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["file.bin"]


# -- background saves -----------------------------------------------------------------------------


def test_background_save_writes_the_state_of_the_moment_it_was_asked(tmp_path):
    state = payload(3)
    pending = checkpoint.save_async(tmp_path, 3, state)
    state["engine"]["model"]["w"].add_(100.0)  # the caller goes on changing its state
    assert pending.wait() == ckpt(tmp_path, 3) and pending.done()
    loaded = checkpoint.load(tmp_path)
    assert torch.equal(loaded["engine"]["model"]["w"], torch.full((3, 2), 3.0))
    assert json.loads(sidecar(tmp_path, 3).read_text())["dir"] == "step-0000003"


def test_background_save_reraises_its_error(tmp_path):
    (tmp_path / "checkpoints").write_text("a file where the directory should be")
    pending = checkpoint.save_async(tmp_path / "checkpoints", 1, payload(1))
    with pytest.raises(OSError):
        pending.wait()


# -- pieces of a tensor several ranks share -------------------------------------------------------


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3, 2)])
def test_flat_ranges_become_at_most_2n_minus_1_contiguous_boxes(shape):
    numel = torch.Size(shape).numel()
    full = torch.arange(numel).view(shape)
    for lo in range(numel):
        for hi in range(lo + 1, numel + 1):
            boxes = _boxes(shape, lo, hi)
            assert len(boxes) <= 2 * len(shape) - 1
            flat = []
            for offsets, sizes in boxes:
                index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                flat += full[index].reshape(-1).tolist()
            assert flat == list(range(lo, hi)), (shape, lo, hi, boxes)


def test_slices_save_in_pieces_and_load_any_other_pieces(tmp_path):
    """Pieces written as chunks of one tensor; any other flat ranges of it read back."""
    full = torch.arange(24.0).view(2, 3, 4)
    flat = full.reshape(-1)
    written = Slices.from_flat(full.shape, [(0, flat[:5]), (5, flat[5:17]), (17, flat[17:])])
    checkpoint.save(tmp_path, 1, {"opt": {"m": written, "step": torch.tensor(3.0)}})
    assert torch.equal(checkpoint.load(tmp_path)["opt"]["m"], full)  # whole, in its shape
    wanted = Slices.empty(full.shape, torch.float32, [(3, 11), (20, 24)])
    state = {"opt": {"m": wanted}}
    found = checkpoint.restore(tmp_path, state)
    assert found.step == 1 and state["opt"]["m"] is wanted
    pieces = wanted.flat_pieces()
    got = torch.cat([t for _, t in sorted(pieces, key=lambda piece: piece[0])])
    assert torch.equal(got, torch.cat([flat[3:11], flat[20:24]]))


def test_restore_loads_stateful_objects_in_place(tmp_path):
    class Tally:
        def __init__(self, n: int) -> None:
            self.n, self.w = n, torch.full((2,), float(n))

        def state_dict(self) -> dict:
            return {"n": self.n, "w": self.w}

        def load_state_dict(self, state: dict) -> None:
            self.n = state["n"]

    checkpoint.save(tmp_path, 4, {"tally": Tally(4)})
    tally = Tally(0)
    checkpoint.restore(tmp_path, {"tally": tally})
    assert tally.n == 4 and torch.equal(tally.w, torch.full((2,), 4.0))


@pytest.mark.parametrize("background", [False, True])
def test_a_group_passed_as_keep_is_named(tmp_path, background):
    """save(dir, step, state, group) puts the group in ``keep``: one line at the call, not a
    TypeError on the background thread (or ranks waiting for each other)."""
    save = checkpoint.save_async if background else checkpoint.save
    with pytest.raises(CheckpointError, match=r"^keep: .*got object \(pass a process group as"):
        save(tmp_path, 1, payload(1), object())
    assert not tmp_path.joinpath("step-0000001").exists()


# -- non-tensor state ------------------------------------------------------------------------------


def scheduler() -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.MultiStepLR]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return opt, torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 5, 5], gamma=0.5)


@pytest.mark.parametrize("background", [False, True])
def test_scheduler_and_none_placeholders_round_trip(tmp_path, background):
    """MultiStepLR's milestones (a Counter of ints: DCP's flattening would make its keys
    strings) and None, saved and as a placeholder for what the checkpoint holds, resume and
    save again (before: ``duplicated flatten key scheduler.milestones.5``)."""
    opt, saved = scheduler()
    for _ in range(3):
        opt.step()
        saved.step()
    state = {"scheduler": saved, "meta": None, "info": {"epoch": 3, "tags": ["a"]}}
    if background:
        checkpoint.save_async(tmp_path, 3, state).wait()
    else:
        checkpoint.save(tmp_path, 3, state)
    _, resumed = scheduler()
    room = {"scheduler": resumed, "meta": {"left": "over"}, "info": None}
    checkpoint.restore(tmp_path, room)
    assert resumed.state_dict() == saved.state_dict()
    assert type(resumed.milestones) is Counter and set(resumed.milestones) == {2, 5}
    assert room["meta"] is None and room["info"] == {"epoch": 3, "tags": ["a"]}
    checkpoint.save(tmp_path, 4, room)  # the resumed state saves again
    loaded = checkpoint.load(tmp_path)
    assert loaded["scheduler"]["milestones"] == Counter({2: 1, 5: 2}) and loaded["meta"] is None


def test_counter_saved_flattened_by_earlier_versions_loads_with_its_keys(tmp_path, monkeypatch):
    """Checkpoints written before such values were kept whole hold the Counter's entries
    under '2' and '5': they load into the Counter's own keys, not beside them."""
    monkeypatch.setattr(_dcp, "_kept_whole", lambda value: value)  # the earlier writing
    opt, saved = scheduler()
    checkpoint.save(tmp_path, 1, {"scheduler": saved})
    monkeypatch.undo()
    _, resumed = scheduler()
    checkpoint.restore(tmp_path, {"scheduler": resumed})
    assert resumed.milestones == Counter({2: 1, 5: 2}), resumed.milestones


def test_values_several_ranks_hold_are_written_by_the_lowest():
    """Rank 0's copy of what every rank holds, as DDP's rank-0 torch.save (DCP's own choice
    balances bytes across ranks, so it may take any rank's copy); what only later ranks hold
    (a pipeline's later stage), the lowest of them."""

    def plan(*names: str) -> SavePlan:
        return SavePlan([WriteItem(MetadataIndex(n), WriteItemType.BYTE_IO) for n in names])

    plans = [plan("a", "b"), plan("a", "b", "rng.1"), plan("b", "stage2"), plan("stage2")]
    written = [[i.index.fqn for i in p.items] for p in _dcp.lowest_rank_writes(plans)]
    assert written == [["a", "b"], ["rng.1"], ["stage2"], []]


@pytest.mark.parametrize(("kwargs", "key"), [({"every": -1}, "every"), ({"keep": 0}, "keep")])
def test_checkpoint_config_checks(kwargs, key):
    with pytest.raises(ConfigError, match=rf"^{key}: must be >= "):
        checkpoint.CheckpointConfig(**kwargs)
    assert checkpoint.CheckpointConfig().async_save is False
