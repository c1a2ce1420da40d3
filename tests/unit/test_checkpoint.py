"""Checkpoints: atomic writes, latest.json pointer, pruning, and verification on load."""

from __future__ import annotations

import hashlib
import io
import json
import os
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


def test_latest_points_at_newest_with_its_hash(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, payload(step), keep=5)
    record = pointer(tmp_path)
    assert record["file"] == "step-0000003.pt" and record["step"] == 3
    data = (tmp_path / record["file"]).read_bytes()
    assert record["sha256"] == hashlib.sha256(data).hexdigest()
    assert checkpoint.load(tmp_path)["step"] == 3


def test_keep_two_prunes_older(tmp_path):
    for step in (10, 20, 30, 40):
        checkpoint.save(tmp_path, step, payload(step), keep=2)
    files = sorted(p.name for p in tmp_path.glob("step-*.pt"))
    assert files == ["step-0000030.pt", "step-0000040.pt"]
    assert checkpoint.load(tmp_path)["step"] == 40


def test_keep_one(tmp_path):
    for step in (1, 2):
        checkpoint.save(tmp_path, step, payload(step), keep=1)
    assert [p.name for p in tmp_path.glob("step-*.pt")] == ["step-0000002.pt"]


def test_save_never_deletes_the_checkpoint_it_just_wrote(tmp_path):
    checkpoint.save(tmp_path, 200, payload(200), keep=1)
    checkpoint.save(tmp_path, 4, payload(4), keep=1)
    assert checkpoint.load(tmp_path)["step"] == 4


def test_truncated_file(tmp_path):
    path = checkpoint.save(tmp_path, 5, payload(5))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    message = load_error(tmp_path)
    assert str(path) in message and "corrupted" in message


def test_flipped_byte(tmp_path):
    path = checkpoint.save(tmp_path, 5, payload(5))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    message = load_error(tmp_path)
    assert str(path) in message and "corrupted" in message


def test_missing_pointer(tmp_path):
    checkpoint.save(tmp_path, 5, payload(5))
    (tmp_path / LATEST).unlink()
    message = load_error(tmp_path)
    assert str(tmp_path) in message and LATEST in message


def test_missing_directory(tmp_path):
    message = load_error(tmp_path / "nowhere")
    assert "no checkpoint" in message


def test_pointer_names_missing_file(tmp_path):
    path = checkpoint.save(tmp_path, 5, payload(5))
    path.unlink()
    message = load_error(tmp_path)
    assert path.name in message and "does not exist" in message


@pytest.mark.parametrize("text", ["{not json", "[]", '{"file": "step-0000005.pt"}', '"x"'])
def test_unreadable_pointer(tmp_path, text):
    checkpoint.save(tmp_path, 5, payload(5))
    (tmp_path / LATEST).write_text(text)
    message = load_error(tmp_path)
    assert str(tmp_path / LATEST) in message and "pointer" in message


def test_matching_hash_but_not_a_checkpoint(tmp_path):
    garbage = b"this is not a torch file"
    (tmp_path / "step-0000001.pt").write_bytes(garbage)
    record = {"file": "step-0000001.pt", "step": 1, "sha256": hashlib.sha256(garbage).hexdigest()}
    (tmp_path / LATEST).write_text(json.dumps(record))
    message = load_error(tmp_path)
    assert "step-0000001.pt" in message and "unreadable" in message


def test_load_refuses_arbitrary_objects(tmp_path):
    """weights_only=True: a pickled class instance is not loaded (and not executed)."""
    buffer = io.BytesIO()
    torch.save({"obj": NotWeights()}, buffer)
    data = buffer.getvalue()
    (tmp_path / "step-0000001.pt").write_bytes(data)
    record = {"file": "step-0000001.pt", "step": 1, "sha256": hashlib.sha256(data).hexdigest()}
    (tmp_path / LATEST).write_text(json.dumps(record))
    message = load_error(tmp_path)
    assert "unreadable" in message


def test_save_leaves_no_temp_files(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, payload(step), keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [LATEST, "step-0000002.pt", "step-0000003.pt"]


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
