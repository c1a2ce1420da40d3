"""Checkpoints: atomic writes, sidecars and latest.json, pruning, verification on load, and
falling back past damaged checkpoints."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import stat
from pathlib import Path

import pytest
import torch

from phalanx import checkpoint
from phalanx.checkpoint import LATEST, atomic_write_bytes, atomic_write_text
from phalanx.errors import CheckpointError, ConfigError


class NotWeights:
    """An arbitrary object: ``torch.load(weights_only=True)`` must refuse to unpickle it."""

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


def pt(directory: Path, step: int) -> Path:
    return directory / f"step-{step:07d}.pt"


def sidecar(directory: Path, step: int) -> Path:
    return directory / f"step-{step:07d}.json"


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def write_raw(directory: Path, step: int, data: bytes) -> Path:
    """A checkpoint in the on-disk format with arbitrary bytes in the .pt."""
    path = pt(directory, step)
    path.write_bytes(data)
    record = {
        "file": path.name,
        "step": step,
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
    }
    sidecar(directory, step).write_text(json.dumps(record))
    (directory / LATEST).write_text(json.dumps(record))
    return path


def torch_bytes(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "phalanx" and r.levelno >= logging.WARNING
    ]


def test_round_trip(tmp_path):
    original = payload(7)
    path = checkpoint.save(tmp_path, 7, original)
    assert path == tmp_path / "step-0000007.pt"
    loaded = checkpoint.load(tmp_path)
    assert loaded.keys() == original.keys()
    assert torch.equal(loaded["engine"]["model"]["w"], original["engine"]["model"]["w"])
    assert loaded["engine"]["num_steps"] == 7
    assert loaded["data"] == {"epoch": 0, "step": 7}
    assert torch.equal(loaded["rng"][0]["cpu"], original["rng"][0]["cpu"])
    assert loaded["name"] == "tiny"


def test_latest_and_sidecar_record_the_newest_with_its_hash_and_size(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, payload(step), keep=5)
    record = pointer(tmp_path)
    assert record["file"] == "step-0000003.pt" and record["step"] == 3
    data = (tmp_path / record["file"]).read_bytes()
    assert record["sha256"] == hashlib.sha256(data).hexdigest()
    assert record["bytes"] == len(data)
    for step in (1, 2, 3):
        own = json.loads(sidecar(tmp_path, step).read_text())
        assert own["file"] == pt(tmp_path, step).name and own["step"] == step
        assert own["sha256"] == hashlib.sha256(pt(tmp_path, step).read_bytes()).hexdigest()
    assert json.loads(sidecar(tmp_path, 3).read_text()) == record
    assert checkpoint.load(tmp_path)["step"] == 3


def test_keep_two_prunes_older_with_their_sidecars(tmp_path):
    for step in (10, 20, 30, 40):
        checkpoint.save(tmp_path, step, payload(step), keep=2)
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert names == ["step-0000030.json", "step-0000030.pt", "step-0000040.json", "step-0000040.pt"]
    assert checkpoint.load(tmp_path)["step"] == 40


def test_keep_one(tmp_path):
    for step in (1, 2):
        checkpoint.save(tmp_path, step, payload(step), keep=1)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-0000002.json",
        "step-0000002.pt",
    ]


def test_save_never_deletes_the_checkpoint_it_just_wrote(tmp_path):
    checkpoint.save(tmp_path, 200, payload(200), keep=1)
    checkpoint.save(tmp_path, 4, payload(4), keep=1)
    assert checkpoint.load(tmp_path)["step"] == 4
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-0000004.json",
        "step-0000004.pt",
    ]


def test_prune_removes_sidecars_without_pt_and_pt_without_sidecar_later(tmp_path):
    checkpoint.save(tmp_path, 1, payload(1), keep=5)
    sidecar(tmp_path, 2).write_text("{}")  # its .pt is gone
    pt(tmp_path, 9).write_bytes(b"interrupted")  # no sidecar, later than the next save
    checkpoint.save(tmp_path, 3, payload(3), keep=5)
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert names == ["step-0000001.json", "step-0000001.pt", "step-0000003.json", "step-0000003.pt"]


# -- one checkpoint, damaged: CheckpointError, one line -------------------------------------------


def test_truncated_file(tmp_path):
    path = checkpoint.save(tmp_path, 5, payload(5))
    truncate(path)
    message = load_error(tmp_path)
    assert str(path) in message and "corrupted" in message and "truncated" in message


def test_flipped_byte(tmp_path):
    path = checkpoint.save(tmp_path, 5, payload(5))
    flip_byte(path)
    message = load_error(tmp_path)
    assert str(path) in message and "corrupted (SHA-256 mismatch)" in message


def test_grown_file(tmp_path):
    path = checkpoint.save(tmp_path, 5, payload(5))
    path.write_bytes(path.read_bytes() + b"x")
    message = load_error(tmp_path)
    assert str(path) in message and "corrupted" in message and "expected" in message


def test_missing_directory(tmp_path):
    message = load_error(tmp_path / "nowhere")
    assert "no checkpoint" in message and str(tmp_path / "nowhere") in message
    assert checkpoint.latest_step(tmp_path / "nowhere") is None


def test_empty_directory(tmp_path):
    message = load_error(tmp_path)
    assert message == f"no checkpoint in {tmp_path}"
    assert checkpoint.latest_step(tmp_path) is None


def test_pt_named_but_missing(tmp_path):
    path = checkpoint.save(tmp_path, 5, payload(5))
    path.unlink()
    message = load_error(tmp_path)
    assert path.name in message and "does not exist" in message
    assert checkpoint.latest_step(tmp_path) is None


def test_garbled_sidecar(tmp_path):
    checkpoint.save(tmp_path, 5, payload(5))
    (tmp_path / LATEST).unlink()
    sidecar(tmp_path, 5).write_text("{not json")
    message = load_error(tmp_path)
    assert "step-0000005.pt" in message and "integrity record" in message


def test_matching_hash_but_not_a_checkpoint(tmp_path):
    write_raw(tmp_path, 1, b"this is not a torch file")
    message = load_error(tmp_path)
    assert "step-0000001.pt" in message and "unreadable" in message


def test_load_refuses_arbitrary_objects(tmp_path):
    """weights_only=True: a pickled class instance is not loaded (and not executed)."""
    write_raw(tmp_path, 1, torch_bytes({"obj": NotWeights()}))
    message = load_error(tmp_path)
    assert "unreadable" in message


# -- several checkpoints: fall back past damaged ones ---------------------------------------------


@pytest.mark.parametrize(
    ("damage", "reason"),
    [(flip_byte, "is corrupted (SHA-256 mismatch)"), (truncate, "is corrupted (truncated to ")],
)
def test_damaged_newest_falls_back_with_one_warning(tmp_path, caplog, damage, reason):
    for step in (10, 20):
        checkpoint.save(tmp_path, step, payload(step))
    damage(pt(tmp_path, 20))
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        loaded = checkpoint.load(tmp_path)
    assert loaded["step"] == 10
    assert torch.equal(loaded["engine"]["model"]["w"], payload(10)["engine"]["model"]["w"])
    (message,) = warnings(caplog)
    assert "\n" not in message
    assert message.startswith(f"phalanx: checkpoint {pt(tmp_path, 20)} {reason}")
    assert message.endswith("; resuming from step-0000010.pt")


def test_unloadable_newest_falls_back(tmp_path, caplog):
    checkpoint.save(tmp_path, 10, payload(10))
    write_raw(tmp_path, 20, torch_bytes({"obj": NotWeights()}))
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        assert checkpoint.load(tmp_path)["step"] == 10
    (message,) = warnings(caplog)
    assert "step-0000020.pt is unreadable" in message and "step-0000010.pt" in message


def test_falls_back_past_several_damaged_with_one_warning(tmp_path, caplog):
    for step in (10, 20, 30):
        checkpoint.save(tmp_path, step, payload(step), keep=3)
    flip_byte(pt(tmp_path, 30))
    truncate(pt(tmp_path, 20))
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        assert checkpoint.load(tmp_path)["step"] == 10
    (message,) = warnings(caplog)
    assert "step-0000030.pt" in message and "resuming from step-0000010.pt" in message


def test_newest_without_sidecar_is_an_interrupted_write_and_never_loaded(tmp_path, caplog):
    """A crash between renaming step 20's .pt into place and writing its sidecar: latest.json
    still names step 10, and the complete-looking step 20 is ignored."""
    checkpoint.save(tmp_path, 10, payload(10))
    atomic_write_bytes(pt(tmp_path, 20), torch_bytes(payload(20)))
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
    atomic_write_bytes(pt(tmp_path, 1), torch_bytes(payload(1)))
    message = load_error(tmp_path)
    assert message.startswith(f"no checkpoint in {tmp_path}")
    assert "step-0000001.pt" in message and "interrupted write" in message
    assert checkpoint.latest_step(tmp_path) is None


def test_all_damaged_is_one_line_naming_the_directory_and_the_newest(tmp_path):
    for step in (10, 20):
        checkpoint.save(tmp_path, step, payload(step))
    flip_byte(pt(tmp_path, 20))
    truncate(pt(tmp_path, 10))
    message = load_error(tmp_path)
    assert message.startswith(f"no good checkpoint in {tmp_path}: ")
    assert f"{pt(tmp_path, 20)} is corrupted (SHA-256 mismatch)" in message
    assert "1 other checkpoint also bad" in message


def test_missing_sidecar_falls_back_to_a_good_one(tmp_path, caplog):
    for step in (10, 20):
        checkpoint.save(tmp_path, step, payload(step))
    pt(tmp_path, 20).unlink()
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        assert checkpoint.load(tmp_path)["step"] == 10
    (message,) = warnings(caplog)
    assert "step-0000020.pt does not exist" in message
    assert checkpoint.latest_step(tmp_path) == 10


# -- latest.json damaged or missing: the sidecars suffice -----------------------------------------


@pytest.mark.parametrize(
    "text", [None, "{not json", "[]", '"x"', '{"file": 7}', '{"file": "elsewhere.pt"}']
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


def test_pointer_without_hash_uses_the_sidecar(tmp_path):
    checkpoint.save(tmp_path, 5, payload(5))
    (tmp_path / LATEST).write_text('{"file": "step-0000005.pt"}')
    assert checkpoint.load(tmp_path)["step"] == 5


def test_missing_pointer_and_damaged_newest_falls_back(tmp_path, caplog):
    for step in (10, 20):
        checkpoint.save(tmp_path, step, payload(step))
    (tmp_path / LATEST).unlink()
    flip_byte(pt(tmp_path, 20))
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        assert checkpoint.load(tmp_path)["step"] == 10
    assert len(warnings(caplog)) == 1


def test_pointer_is_tried_first(tmp_path):
    """A crash after step 20's sidecar but before latest.json: step 10, which latest.json names,
    is still the one resumed from (and step 20 is the fallback)."""
    checkpoint.save(tmp_path, 10, payload(10))
    saved = (tmp_path / LATEST).read_text()
    checkpoint.save(tmp_path, 20, payload(20))
    (tmp_path / LATEST).write_text(saved)
    assert checkpoint.latest_step(tmp_path) == 10
    assert checkpoint.load(tmp_path)["step"] == 10
    flip_byte(pt(tmp_path, 10))
    assert checkpoint.load(tmp_path)["step"] == 20


def test_checkpoint_from_before_sidecars_loads_by_its_pointer(tmp_path):
    """latest.json without sidecars (and without "bytes") is the record of the file it names."""
    path = checkpoint.save(tmp_path, 5, payload(5))
    sidecar(tmp_path, 5).unlink()
    data = path.read_bytes()
    record = {"file": path.name, "step": 5, "sha256": hashlib.sha256(data).hexdigest()}
    (tmp_path / LATEST).write_text(json.dumps(record))
    assert checkpoint.latest_step(tmp_path) == 5
    assert checkpoint.load(tmp_path)["step"] == 5
    flip_byte(path)
    assert "corrupted (SHA-256 mismatch)" in load_error(tmp_path)


# -- latest_step ----------------------------------------------------------------------------------


def test_latest_step_does_not_read_the_checkpoint(tmp_path):
    for step in (10, 20):
        checkpoint.save(tmp_path, step, payload(step))
    flip_byte(pt(tmp_path, 20))
    assert checkpoint.latest_step(tmp_path) == 20  # looks complete; load() would fall back


# -- temporary files and atomic writes ------------------------------------------------------------


def test_save_leaves_no_temp_files(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, payload(step), keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        LATEST,
        "step-0000002.json",
        "step-0000002.pt",
        "step-0000003.json",
        "step-0000003.pt",
    ]


def test_stray_temp_files_are_ignored_and_cleaned_by_the_next_save(tmp_path):
    checkpoint.save(tmp_path, 1, payload(1))
    strays = [
        tmp_path / ".step-0000002.pt.abc123.tmp",
        tmp_path / ".step-0000002.json.def456.tmp",
        tmp_path / f".{LATEST}.ghi789.tmp",
    ]
    for stray in strays:
        stray.write_bytes(b"partial")
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
    assert len(directories) == 3  # after each rename: .pt, sidecar, latest.json


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


@pytest.mark.parametrize(("kwargs", "key"), [({"every": -1}, "every"), ({"keep": 0}, "keep")])
def test_checkpoint_config_checks(kwargs, key):
    with pytest.raises(ConfigError, match=rf"^{key}: must be >= "):
        checkpoint.CheckpointConfig(**kwargs)
