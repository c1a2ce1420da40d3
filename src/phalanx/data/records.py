"""Record store: samples in shard files, each with a record index and checksums (storage of F2).

A store is a directory::

    index.json        format, fields (name, dtype, shape; -1 marks a variable dim), shards
                      (file, records, bytes, sha256), meta (source, split, num_classes, ...)
    shard-00000.rec   one shard: header, record index, record payloads

Shard file layout (little-endian)::

    magic            8 bytes  b"PHXREC01"
    num_records n    u64
    table_crc32      u32      crc32 of the two tables below
    reserved         u32      0
    offsets          u64[n+1] record i is payload[offsets[i]:offsets[i+1]]
    record_crc32     u32[n]   crc32 of each record's bytes
    payload

A record is its fields in order; a field with variable dims starts with those dims (u32 each),
then the array's bytes in C order. Every read checks the record's crc32, so a corrupted byte is
reported with the shard file and the record; ``verify()`` also checks each shard's SHA-256.
Shards and the index are written atomically; the index last, so a crash leaves no store.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from phalanx.errors import DataError
from phalanx.fileio import atomic_write_bytes, atomic_write_text

FORMAT = "phalanx-records"
VERSION = 1
INDEX = "index.json"
MAGIC = b"PHXREC01"
HEADER_BYTES = 24  # magic, n, table crc, reserved
VARIABLE = -1
Record = tuple[np.ndarray, ...]


# -- schema --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    """One array of every record: its dtype and shape (``-1`` where records differ)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def variable(self) -> bool:
        return VARIABLE in self.shape

    @property
    def nbytes(self) -> int:
        """Bytes of a fixed field (asserts the field is fixed)."""
        assert not self.variable
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def encode(self, array: np.ndarray) -> bytes:
        array = np.asarray(array, dtype=self.dtype, order="C")  # keeps 0-d arrays 0-d
        if array.ndim != len(self.shape) or any(
            want not in (VARIABLE, got) for want, got in zip(self.shape, array.shape)
        ):
            raise DataError(
                f"field {self.name!r}: shape {array.shape} does not match {self.shape_text()}"
            )
        dims = [d for d, want in zip(array.shape, self.shape) if want == VARIABLE]
        return np.asarray(dims, dtype="<u4").tobytes() + array.tobytes()

    def decode(self, buffer: bytes | bytearray | memoryview, offset: int) -> tuple[np.ndarray, int]:
        """The array stored at ``offset`` and the offset after it."""
        shape = list(self.shape)
        variable = [i for i, d in enumerate(shape) if d == VARIABLE]
        if variable:
            dims = np.frombuffer(buffer, dtype="<u4", count=len(variable), offset=offset)
            for i, d in zip(variable, dims.tolist()):
                shape[i] = d
            offset += 4 * len(variable)
        dtype = np.dtype(self.dtype)
        count = int(np.prod(shape, dtype=np.int64))
        array = np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)
        return array, offset + count * dtype.itemsize

    def shape_text(self) -> str:
        return "(" + ", ".join("*" if d == VARIABLE else str(d) for d in self.shape) + ")"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


def infer_fields(
    names: Sequence[str], dtypes: Sequence[Any], shapes: Iterable[Sequence[tuple[int, ...]]]
) -> tuple[Field, ...]:
    """Fields from the per-record shapes seen: dims that differ between records become -1."""
    merged: list[list[int] | None] = [None] * len(names)
    for record_shapes in shapes:
        for i, shape in enumerate(record_shapes):
            known = merged[i]
            if known is None:
                merged[i] = list(shape)
            elif len(known) != len(shape):
                raise DataError(
                    f"field {names[i]!r}: records have {len(known)} and {len(shape)} dims; "
                    "variable-length records may differ in sizes, not in the number of dims"
                )
            else:
                merged[i] = [a if a == b else VARIABLE for a, b in zip(known, shape)]
    return tuple(
        Field(name, np.dtype(dtype).str, tuple(shape or ()))
        for name, dtype, shape in zip(names, dtypes, merged)
    )


def fixed_record_dtype(fields: Sequence[Field]) -> np.dtype | None:
    """A packed structured dtype of a fixed-size record (None if any field is variable)."""
    if any(f.variable for f in fields):
        return None
    return np.dtype([(f.name, np.dtype(f.dtype), f.shape) for f in fields])


# -- writing -------------------------------------------------------------------------------------
@dataclass
class _PendingShard:
    records: list[bytes] = field(default_factory=list)
    num_bytes: int = 0


def encode_shard(records: Sequence[bytes]) -> bytes:
    """One shard file's bytes: header, record index, payload."""
    lengths = np.fromiter((len(r) for r in records), dtype=np.uint64, count=len(records))
    offsets = np.zeros(len(records) + 1, dtype="<u8")
    np.cumsum(lengths, out=offsets[1:])
    crcs = np.fromiter((zlib.crc32(r) for r in records), dtype="<u4", count=len(records))
    table = offsets.tobytes() + crcs.tobytes()
    header = MAGIC + np.array([len(records)], "<u8").tobytes()
    header += np.array([zlib.crc32(table), 0], "<u4").tobytes()
    return header + table + b"".join(records)


class RecordWriter:
    """Appends records (tuples of arrays matching ``fields``) into shards of ~``shard_bytes``;
    as a context manager the index is written on a clean exit only (a crash leaves no store)."""

    def __init__(
        self, out_dir: Path, fields: Sequence[Field], shard_bytes: int, meta: dict | None = None
    ) -> None:
        if shard_bytes < 1:
            raise DataError(f"shard size must be > 0 bytes, got {shard_bytes}")
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and (not self.out_dir.is_dir() or any(self.out_dir.iterdir())):
            raise DataError(
                f"{self.out_dir}: exists and is not an empty directory; pack into a new "
                "directory, or delete this one first"
            )
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.fields = tuple(fields)
        self.shard_bytes = shard_bytes
        self.meta = dict(meta or {})
        self.shards: list[dict[str, Any]] = []
        self.num_records = 0
        self._pending = _PendingShard()

    def add(self, record: Sequence[np.ndarray]) -> None:
        if len(record) != len(self.fields):
            raise DataError(
                f"record {self.num_records}: {len(record)} arrays, expected {len(self.fields)} "
                f"({', '.join(f.name for f in self.fields)})"
            )
        try:
            data = b"".join(f.encode(np.asarray(a)) for f, a in zip(self.fields, record))
        except DataError as e:
            raise DataError(f"record {self.num_records}: {e}") from None
        self._pending.records.append(data)
        self._pending.num_bytes += len(data)
        self.num_records += 1
        if self._pending.num_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._pending.records:
            return
        data = encode_shard(self._pending.records)
        name = f"shard-{len(self.shards):05d}.rec"
        atomic_write_bytes(self.out_dir / name, data)
        count, sha = len(self._pending.records), hashlib.sha256(data).hexdigest()
        self.shards.append({"file": name, "records": count, "bytes": len(data), "sha256": sha})
        self._pending = _PendingShard()

    def close(self) -> Path:
        """Write the last shard and the index; returns the index path."""
        self._flush()
        fields = [f.to_json() for f in self.fields]
        index = {"format": FORMAT, "version": VERSION, "num_records": self.num_records,
                 "fields": fields, "shards": self.shards, "meta": self.meta}  # fmt: skip
        path = self.out_dir / INDEX
        atomic_write_text(path, json.dumps(index, indent=2) + "\n")
        return path

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()


# -- reading -------------------------------------------------------------------------------------
@dataclass
class _Shard:
    """One opened shard: where its records are and their checksums."""

    path: Path
    first: int  # store index of its record 0
    num_records: int
    num_bytes: int
    sha256: str
    payload_start: int
    offsets: np.ndarray  # (n+1,) uint64
    crcs: np.ndarray  # (n,) uint32

    def where(self, local: int) -> str:
        return f"{self.path}: record {local} (store record {self.first + local})"


class RecordStore:
    """A store opened for reading, also a map-style dataset; safe to share between threads
    (``os.pread``) and to pickle into worker processes (files are reopened there)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        index = _read_index(self.path)
        self.fields = tuple(_field_from_json(self.path, f) for f in index["fields"])
        self.meta: dict[str, Any] = dict(index.get("meta", {}))
        self.record_dtype = fixed_record_dtype(self.fields)
        self.shards = _open_shards(self.path, index)
        self.num_records = int(index["num_records"])
        self._starts = np.array([s.first for s in self.shards], dtype=np.int64)
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    # -- map-style dataset
    def __len__(self) -> int:
        return self.num_records

    def __getitem__(self, index: int) -> Record:
        if not -self.num_records <= index < self.num_records:
            raise IndexError(f"record {index} out of range for {self.num_records} records")
        return self._decode(self._read_one(index % self.num_records))

    # -- batches
    def read_batch(
        self, indices: Sequence[int] | np.ndarray, empty: Callable[..., np.ndarray] = np.empty
    ) -> tuple[np.ndarray, ...] | list[Record]:
        """Fixed records: one array per field, (B, *shape), allocated by ``empty(shape, dtype)``.
        Variable records: a list of records."""
        raw = self._read_many(np.asarray(indices, dtype=np.int64))
        if self.record_dtype is None:
            return [self._decode(r) for r in raw]
        table = np.frombuffer(b"".join(raw), dtype=self.record_dtype)
        out = []
        for f in self.fields:
            array = empty((len(raw), *f.shape), np.dtype(f.dtype))
            array[...] = table[f.name]
            out.append(array)
        return tuple(out)

    def _read_one(self, index: int) -> bytes:
        return self._read_many(np.array([index], dtype=np.int64))[0]

    def _read_many(self, indices: np.ndarray) -> list[bytes]:
        """Records' bytes, crc-checked; the index arithmetic is vectorised (this runs in the
        pipeline's I/O thread, where every Python step holds the GIL)."""
        shard_ids = np.searchsorted(self._starts, indices, side="right") - 1
        local = indices - self._starts[shard_ids]
        starts, ends, crcs = (np.empty(len(indices), np.int64) for _ in range(3))
        for shard_id in np.unique(shard_ids).tolist():
            pick = shard_ids == shard_id
            shard, here = self.shards[shard_id], local[pick]
            starts[pick] = shard.offsets[here].astype(np.int64) + shard.payload_start
            ends[pick] = shard.offsets[here + 1].astype(np.int64) + shard.payload_start
            crcs[pick] = shard.crcs[here]
        out = []
        rows = zip(shard_ids.tolist(), starts.tolist(), ends.tolist(), crcs.tolist())
        for shard_id, start, end, crc in rows:
            data = os.pread(self._fd(shard_id), end - start, start)
            if len(data) != end - start or zlib.crc32(data) != crc:
                self._raise_bad_record(shard_id, start, len(data) != end - start)
            out.append(data)
        return out

    def _raise_bad_record(self, shard_id: int, start: int, truncated: bool) -> None:
        shard = self.shards[shard_id]
        local = int(np.searchsorted(shard.offsets, start - shard.payload_start, side="right")) - 1
        if truncated:
            raise DataError(f"{shard.where(local)}: truncated (file shorter than its index)")
        raise DataError(f"{shard.where(local)}: checksum mismatch (corrupted data)")

    def _decode(self, data: bytes) -> Record:
        buffer = bytearray(data)  # writable arrays: callers may modify what they get
        out, offset = [], 0
        for f in self.fields:
            array, offset = f.decode(buffer, offset)
            out.append(array)
        return tuple(out)

    def _fd(self, shard_id: int) -> int:
        if self._pid != os.getpid():  # a forked child must not share file offsets or locks
            self._fds, self._pid, self._lock = {}, os.getpid(), threading.Lock()
        fd = self._fds.get(shard_id)
        if fd is None:
            with self._lock:
                fd = self._fds.get(shard_id)
                if fd is None:
                    fd = os.open(self.shards[shard_id].path, os.O_RDONLY)
                    self._fds[shard_id] = fd
        return fd

    # -- checks and summary
    def verify(self) -> None:
        """Hash every shard against the index and check every record's crc32."""
        for shard in self.shards:
            digest = hashlib.sha256()
            with shard.path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):  # noqa: B023
                    digest.update(chunk)
            if digest.hexdigest() == shard.sha256:
                continue
            for local in range(shard.num_records):  # name the first bad record
                self._read_one(shard.first + local)
            raise DataError(f"{shard.path}: SHA-256 differs from {INDEX} (header corrupted)")

    def summary(self) -> dict[str, Any]:
        sizes: np.ndarray | list[int] = (
            np.concatenate([np.diff(s.offsets) for s in self.shards]) if self.shards else []
        )
        return {
            "path": str(self.path),
            "num_records": self.num_records,
            "num_shards": len(self.shards),
            "bytes": sum(s.num_bytes for s in self.shards),
            "fixed": self.record_dtype is not None,
            "record_bytes_min": int(np.min(sizes)) if len(sizes) else 0,
            "record_bytes_max": int(np.max(sizes)) if len(sizes) else 0,
            "record_bytes_mean": float(np.mean(sizes)) if len(sizes) else 0.0,
            "fields": [f.to_json() for f in self.fields],
            "meta": self.meta,
        }

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> RecordStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_pid", None) == os.getpid():
            self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fds"], state["_lock"], state["_pid"] = {}, None, -1
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._pid = threading.Lock(), os.getpid()

    def __iter__(self) -> Iterator[Record]:
        for i in range(self.num_records):
            yield self[i]


# -- opening checks ------------------------------------------------------------------------------
def _read_index(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        what = "not a directory" if path.exists() else "no such directory"
        raise DataError(f"record store {path}: {what}")
    index_path = path / INDEX
    if not index_path.is_file():
        raise DataError(
            f"{path} is not a record store (no {INDEX}; write one with `phalanx data pack`)"
        )
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{index_path}: not a record index ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DataError(f"{index_path}: not a phalanx record index (format != {FORMAT!r})")
    if index.get("version") != VERSION:
        raise DataError(f"{index_path}: version {index.get('version')!r}; supported: {VERSION}")
    for key, kind in (("num_records", int), ("fields", list), ("shards", list)):
        if not isinstance(index.get(key), kind):
            raise DataError(f"{index_path}: {key!r} missing or not a {kind.__name__}")
    return index


def _field_from_json(path: Path, data: Any) -> Field:
    try:
        shape = tuple(int(d) for d in data["shape"])
        return Field(str(data["name"]), np.dtype(data["dtype"]).str, shape)
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{path / INDEX}: bad field entry {data!r} ({e})") from None


def _open_shards(path: Path, index: dict[str, Any]) -> list[_Shard]:
    shards, first = [], 0
    for entry in index["shards"]:
        try:
            file, count = str(entry["file"]), int(entry["records"])
            size, sha = int(entry["bytes"]), str(entry["sha256"])
        except (KeyError, TypeError, ValueError):
            raise DataError(f"{path / INDEX}: bad shard entry {entry!r}") from None
        shards.append(_open_shard(path / file, first, count, size, sha))
        first += count
    if first != index["num_records"]:
        raise DataError(
            f"{path / INDEX}: num_records {index['num_records']} but the shards hold {first}"
        )
    return shards


def _open_shard(path: Path, first: int, count: int, size: int, sha: str) -> _Shard:
    if not path.is_file():
        raise DataError(f"{path}: shard listed in {INDEX} is missing")
    actual = path.stat().st_size
    table_bytes = 12 * count + 8
    with path.open("rb") as f:
        head = f.read(HEADER_BYTES + table_bytes)
    if len(head) >= len(MAGIC) and head[: len(MAGIC)] != MAGIC:
        raise DataError(f"{path}: not a phalanx shard (bad magic)")
    if len(head) < HEADER_BYTES + table_bytes:
        raise DataError(f"{path}: truncated in its header ({actual} bytes)")
    n = int(np.frombuffer(head, "<u8", 1, 8)[0])
    if n != count:
        raise DataError(f"{path}: holds {n} records but {INDEX} says {count}")
    table = head[HEADER_BYTES:]
    if zlib.crc32(table) != int(np.frombuffer(head, "<u4", 1, 16)[0]):
        raise DataError(f"{path}: record index checksum mismatch (corrupted header)")
    offsets = np.frombuffer(table, "<u8", n + 1).astype(np.uint64)
    crcs = np.frombuffer(table, "<u4", n, 8 * (n + 1))
    shard = _Shard(path, first, n, size, sha, HEADER_BYTES + table_bytes, offsets, crcs)
    expected = shard.payload_start + int(offsets[-1])
    if actual < expected:
        ends = shard.payload_start + offsets[1:].astype(np.int64)
        local = int(np.argmax(ends > actual))
        raise DataError(f"{shard.where(local)}: truncated ({actual} of {expected} bytes)")
    if actual != expected or size != expected:
        raise DataError(
            f"{path}: {actual} bytes; its header implies {expected}, {INDEX} says {size}"
        )
    return shard


def write_store(
    out_dir: Path,
    fields: Sequence[Field],
    records: Iterable[Sequence[np.ndarray]],
    shard_bytes: int = 64 << 20,
    meta: dict[str, Any] | None = None,
) -> RecordStore:
    """Pack ``records`` into a new store at ``out_dir`` and open it."""
    with RecordWriter(out_dir, fields, shard_bytes, meta) as writer:
        for record in records:
            writer.add(record)
    return RecordStore(out_dir)
