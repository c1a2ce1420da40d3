"""Packing a built-in source's split or a directory of .npz/.npy files into a record store
(docs/data.md); files in sorted name order, so packing is reproducible."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from phalanx.data.records import Field, Record, RecordStore, infer_fields, write_store
from phalanx.data.sources import SOURCES, DataConfig, load_source
from phalanx.errors import DataError

SPLITS = ("train", "val")
Packable = tuple[tuple[Field, ...], Iterator[Record], dict[str, Any]]


def pack(
    source: str, out_dir: str | Path, shard_mb: float = 64.0, split: str = "train"
) -> RecordStore:
    """Write ``source`` (a built-in name or a directory) as a record store at ``out_dir``."""
    if shard_mb <= 0:
        raise DataError(f"--shard-mb: must be > 0, got {shard_mb}")
    path = Path(source)
    if path.is_dir():
        fields, records, meta = from_directory(path)
    elif source in SOURCES:
        fields, records, meta = from_builtin(source, split)
    else:
        raise DataError(
            f"SOURCE {source!r}: not a directory and not a built-in source "
            f"(known: {', '.join(SOURCES.names())})"
        )
    return write_store(Path(out_dir), fields, records, max(1, int(shard_mb * 2**20)), meta)


def from_builtin(name: str, split: str) -> Packable:
    """One split of a built-in source: fields x and y, one record per sample."""
    if split not in SPLITS:
        raise DataError(f"--split: got {split!r}; allowed: {', '.join(SPLITS)}")
    config = DataConfig(source=name)
    data = load_source(config)
    x, y = (data.x_train, data.y_train) if split == "train" else (data.x_val, data.y_val)
    x_np, y_np = x.numpy(), y.numpy()
    fields = tuple(Field(k, a.dtype.str, tuple(a.shape[1:])) for k, a in (("x", x_np), ("y", y_np)))
    meta = {"source": name, "split": split, "num_classes": data.num_classes,
            "val_fraction": config.val_fraction}  # fmt: skip
    return fields, zip(x_np, y_np), meta


def from_directory(path: Path) -> Packable:
    npz, npy = sorted(path.glob("*.npz")), sorted(path.glob("*.npy"))
    if npz and npy:
        raise DataError(f"{path}: mixes .npz and .npy files; use one kind per store")
    if npz:
        return _from_npz(path, npz)
    if npy:
        return _from_npy(path, npy)
    raise DataError(f"{path}: no .npy or .npz files to pack")


def _load(file: Path, mmap: bool = False) -> Any:
    try:
        return np.load(file, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"{file}: not a readable numpy file ({e})") from None


def _field_order(keys: list[str]) -> list[str]:
    first = [k for k in ("x", "y") if k in keys]
    return first + sorted(k for k in keys if k not in first)


def _from_npz(root: Path, files: list[Path]) -> Packable:
    names: list[str] | None = None
    dtypes: list[Any] = []
    shapes: list[tuple[tuple[int, ...], ...]] = []
    for file in files:
        with _load(file) as archive:
            keys = _field_order(list(archive.files))
            if names is None:
                names = keys
                dtypes = [archive[k].dtype for k in names]
            elif keys != names:
                raise DataError(f"{file}: arrays {keys}, but {files[0].name} has {names}")
            arrays = [archive[k] for k in names]
        lengths = {len(a) if a.ndim else -1 for a in arrays}
        if len(lengths) != 1 or -1 in lengths:
            raise DataError(f"{file}: arrays {names} need one common first dim (records)")
        for name, array, dtype in zip(names, arrays, dtypes):
            if array.dtype != dtype:
                raise DataError(f"{file}: {name!r} is {array.dtype}, other files have {dtype}")
        shapes.append(tuple(a.shape[1:] for a in arrays))
    assert names is not None
    fields = infer_fields(names, dtypes, shapes)
    return fields, _npz_records(files, names), {"source": str(root), "files": len(files)}


def _npz_records(files: list[Path], names: list[str]) -> Iterator[Record]:
    for file in files:
        with _load(file) as archive:
            arrays = [archive[k] for k in names]
        yield from zip(*arrays)


def _from_npy(root: Path, files: list[Path]) -> Packable:
    heads = [_load(f, mmap=True) for f in files]
    dtypes = {h.dtype for h in heads}
    if len(dtypes) != 1:
        raise DataError(f"{root}: .npy files have different dtypes {sorted(map(str, dtypes))}")
    fields = infer_fields(["x"], [heads[0].dtype], ((h.shape,) for h in heads))
    del heads  # release the memory maps
    records = ((np.asarray(_load(f)),) for f in files)
    return fields, records, {"source": str(root), "files": len(files)}
