"""Record stores: round trips (fixed and variable records), packing sources, the CLI, and every
kind of bad store (missing, not a store, index disagreeing, corrupted, truncated)."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from phalanx.cli import main
from phalanx.data.pack import pack
from phalanx.data.records import INDEX, Field, RecordStore, RecordWriter, write_store
from phalanx.errors import DataError

IMAGE, LABEL = Field("x", "<f4", (2, 3)), Field("y", "<i8", ())


def images(n: int = 20) -> tuple[np.ndarray, np.ndarray]:
    x = np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3) / 7
    return x, np.arange(n, dtype=np.int64) * 3


def image_store(path: Path, n: int = 20, shard_bytes: int = 100) -> RecordStore:
    x, y = images(n)
    return write_store(path, (IMAGE, LABEL), zip(x, y), shard_bytes, meta={"kind": "test"})


def sequences(n: int = 9) -> list[np.ndarray]:
    return [np.arange(i + 1, dtype=np.int64) * (i + 1) for i in range(n)]


def one_line_error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("phalanx: error: "), err
    assert "Traceback" not in err
    return lines[0]


# -- round trips ----------------------------------------------------------------------------------
def test_fixed_records_round_trip_across_shards(tmp_path):
    x, y = images()
    with image_store(tmp_path / "s") as store:
        assert len(store) == 20 and len(store.shards) > 3  # 32-byte records, ~100-byte shards
        assert store.record_dtype is not None and store.meta == {"kind": "test"}
        for i in (0, 7, 19, -1):
            xi, yi = store[i]
            assert np.array_equal(xi, x[i]) and yi.shape == () and int(yi) == y[i]
        order = np.array([19, 0, 5, 5, 12])
        bx, by = store.read_batch(order)
        assert bx.shape == (5, 2, 3) and bx.dtype == np.float32 and by.dtype == np.int64
        assert np.array_equal(bx, x[order]) and np.array_equal(by, y[order])
        bx[0] = -1  # batches and records are writable copies, not views of the store
        assert np.array_equal(store[19][0], x[19])
        summary = store.summary()
        assert summary["fixed"] and summary["record_bytes_min"] == summary["record_bytes_max"] == 32
        assert summary["num_records"] == 20 and summary["num_shards"] == len(store.shards)
        store.verify()
        with pytest.raises(IndexError):
            store[20]


def test_variable_records_round_trip(tmp_path):
    seqs = sequences()
    fields = (Field("tokens", "<i8", (-1,)), Field("label", "<i4", ()))
    records = [(s, np.int32(i)) for i, s in enumerate(seqs)]
    with write_store(tmp_path / "v", fields, records, shard_bytes=64) as store:
        assert store.record_dtype is None and not store.summary()["fixed"]
        for i, s in enumerate(seqs):
            tokens, label = store[i]
            assert np.array_equal(tokens, s) and int(label) == i
        batch = store.read_batch([3, 0])
        assert [len(r[0]) for r in batch] == [4, 1]
        store.verify()


def test_store_survives_pickling(tmp_path):
    with image_store(tmp_path / "s") as store:
        store[3]  # opens a file descriptor, which must not travel
        clone = pickle.loads(pickle.dumps(store))
        assert np.array_equal(clone[3][0], store[3][0])
        clone.close()


# -- packing --------------------------------------------------------------------------------------
def test_pack_digits_from_the_cli_then_inspect(tmp_path, capsys):
    out = tmp_path / "digits"
    with pytest.raises(SystemExit) as info:
        main(["data", "pack", "digits", str(out), "--shard-mb", "0.1"])
    assert info.value.code == 0
    assert "packed 1438 records" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["data", "inspect", str(out), "--verify"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "1438 records" in text and "float32" in text and "(1, 8, 8)" in text
    assert "verified" in text and "split=train" in text
    from phalanx.data import DataConfig, load_source

    data = load_source(DataConfig())
    with RecordStore(out) as store:
        assert len(store.shards) == 4  # 0.1 MiB shards of 264-byte records
        x, y = store.read_batch(np.arange(len(store)))
        assert np.array_equal(x, data.x_train.numpy()) and np.array_equal(y, data.y_train.numpy())
    with pytest.raises(SystemExit):
        main(["data", "inspect", str(out), "--json"])
    assert json.loads(capsys.readouterr().out)["meta"]["source"] == "digits"


def test_pack_the_text_source_as_token_sequences(tmp_path):
    from phalanx.data import DataConfig, load_source

    data = load_source(DataConfig(source="text"))
    with pack("text", tmp_path / "text", split="val") as store:
        assert [(f.name, f.dtype, f.shape) for f in store.fields] == [
            ("x", "<i8", (64,)),
            ("y", "<i8", (64,)),
        ]
        x, y = store.read_batch([0, len(store) - 1])
        assert np.array_equal(x, data.x_val[[0, -1]].numpy())
        assert np.array_equal(y, data.y_val[[0, -1]].numpy())
        assert store.meta["split"] == "val" and len(store) == len(data.x_val)


def test_pack_a_directory_of_npz_files(tmp_path):
    src = tmp_path / "npz"
    src.mkdir()
    np.savez(src / "a.npz", y=np.arange(3), x=np.ones((3, 4), np.float32), w=np.zeros(3))
    np.savez(src / "b.npz", y=np.arange(2), x=np.ones((2, 5), np.float32), w=np.zeros(2))
    with pack(str(src), tmp_path / "out") as store:
        assert [f.name for f in store.fields] == ["x", "y", "w"]  # x, y first
        assert store.fields[0].shape == (-1,)  # 4 vs 5 columns: variable
        assert len(store) == 5 and store[4][0].shape == (5,) and int(store[4][1]) == 1


def test_pack_a_directory_of_npy_token_sequences(tmp_path):
    src = tmp_path / "npy"
    src.mkdir()
    for i, s in enumerate(sequences(4)):
        np.save(src / f"{i:03d}.npy", s)
    with pack(str(src), tmp_path / "out", shard_mb=0.0001) as store:
        assert store.fields == (Field("x", "<i8", (-1,)),)
        assert [store[i][0].tolist() for i in range(4)] == [s.tolist() for s in sequences(4)]


def test_pack_bad_inputs(tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "junk.npy").write_bytes(b"not numpy")
    assert "junk.npy: not a readable numpy file" in one_line_error(
        capsys, ["data", "pack", str(bad), str(tmp_path / "o1")]
    )
    assert "not a directory and not a built-in source" in one_line_error(
        capsys, ["data", "pack", "no-such-thing", str(tmp_path / "o2")]
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no .npy or .npz files" in one_line_error(
        capsys, ["data", "pack", str(empty), str(tmp_path / "o3")]
    )
    assert "not an empty directory" in one_line_error(capsys, ["data", "pack", "digits", str(bad)])
    assert "--split" in one_line_error(
        capsys, ["data", "pack", "digits", str(tmp_path / "o4"), "--split", "test"]
    )


def test_writer_rejects_records_that_do_not_match_the_fields(tmp_path):
    with pytest.raises(DataError, match=r"record 1: field 'x': shape \(3, 2\) does not match"):
        with RecordWriter(tmp_path / "w", (IMAGE, LABEL), 1000) as writer:
            writer.add((np.zeros((2, 3)), 1))
            writer.add((np.zeros((3, 2)), 1))
    assert not (tmp_path / "w" / INDEX).exists()  # an interrupted pack is not a store


# -- bad stores -----------------------------------------------------------------------------------
@pytest.fixture
def store_dir(tmp_path) -> Path:
    image_store(tmp_path / "s").close()
    return tmp_path / "s"


def _index(path: Path) -> dict:
    return json.loads((path / INDEX).read_text())


def _write_index(path: Path, index: dict) -> None:
    (path / INDEX).write_text(json.dumps(index))


def test_missing_directory_and_non_stores_are_one_line_errors(tmp_path, capsys):
    assert "no such directory" in one_line_error(capsys, ["data", "inspect", str(tmp_path / "x")])
    (tmp_path / "file").write_text("hi")
    assert "not a directory" in one_line_error(capsys, ["data", "inspect", str(tmp_path / "file")])
    assert "is not a record store (no index.json" in one_line_error(
        capsys, ["data", "inspect", str(tmp_path)]
    )
    (tmp_path / INDEX).write_text("{ not json")
    assert "index.json: not a record index" in one_line_error(
        capsys, ["data", "inspect", str(tmp_path)]
    )
    (tmp_path / INDEX).write_text(json.dumps({"format": "other"}))
    assert "not a phalanx record index" in one_line_error(
        capsys, ["data", "inspect", str(tmp_path)]
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda ix: ix.update(num_records=21), "num_records 21 but the shards hold 20"),
        (lambda ix: ix["shards"][1].update(records=9), "holds 4 records but index.json says 9"),
        (lambda ix: ix["shards"][2].update(file="gone.rec"), "gone.rec: shard listed in"),
        (lambda ix: ix["shards"][0].update(bytes=1), "index.json says 1"),
        (lambda ix: ix["shards"].pop(), "num_records 20 but the shards hold"),
        (lambda ix: ix["fields"][0].update(dtype="nope"), "bad field entry"),
    ],
)
def test_an_index_that_disagrees_with_the_shards(store_dir, change, message):
    index = _index(store_dir)
    change(index)
    _write_index(store_dir, index)
    with pytest.raises(DataError, match=message) as info:
        RecordStore(store_dir)
    assert "\n" not in str(info.value)


def test_a_corrupted_record_names_the_file_and_the_record(store_dir):
    shard = store_dir / "shard-00001.rec"
    data = bytearray(shard.read_bytes())
    data[-40] ^= 0xFF  # inside the second-to-last record of the shard (32-byte records)
    shard.write_bytes(bytes(data))
    with RecordStore(store_dir) as store:  # opening checks sizes and headers only
        first = store.shards[1].first
        n = store.shards[1].num_records
        store[first]  # other records still read
        expected = f"shard-00001.rec: record {n - 2} \\(store record {first + n - 2}\\)"
        with pytest.raises(DataError, match=expected + ": checksum mismatch"):
            store[first + n - 2]
        with pytest.raises(DataError, match=expected):
            store.verify()


def test_a_truncated_shard_names_the_file_and_the_record(store_dir, capsys):
    shard = store_dir / "shard-00002.rec"
    shard.write_bytes(shard.read_bytes()[:-40])  # cuts into the last two records
    line = one_line_error(capsys, ["data", "inspect", str(store_dir)])
    n = _index(store_dir)["shards"][2]["records"]
    assert f"shard-00002.rec: record {n - 2} (store record" in line and "truncated" in line
    shard.write_bytes(shard.read_bytes()[:10])
    assert "truncated in its header" in one_line_error(capsys, ["data", "inspect", str(store_dir)])


def test_a_corrupted_header_or_foreign_file(store_dir):
    shard = store_dir / "shard-00000.rec"
    data = bytearray(shard.read_bytes())
    data[30] ^= 0x01  # in the offsets table
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="shard-00000.rec: record index checksum mismatch"):
        RecordStore(store_dir)
    shutil.copy(store_dir / INDEX, shard)
    with pytest.raises(DataError, match="shard-00000.rec: not a phalanx shard"):
        RecordStore(store_dir)
