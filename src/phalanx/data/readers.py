"""Adapters from what a Pipeline reads (a record store, a built-in source or Dataset, arrays, a
map-style dataset; docs/data.md) to one ``Reader`` protocol."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from phalanx.data.records import RecordStore
from phalanx.data.sources import SOURCES, DataConfig, Dataset, load_source
from phalanx.errors import DataError

Batch = tuple[torch.Tensor, ...]
Sample = Any  # one item of a map-style dataset
Collate = Callable[[Sequence[Sample]], Batch]


class Reader(Protocol):
    """``read(indices)`` -> one CPU tensor (len(indices), ...) per field; ``name`` for messages."""

    name: str

    def __len__(self) -> int: ...

    def read(self, indices: np.ndarray) -> Batch: ...


# -- collate ---------------------------------------------------------------------------------------
def _fields(sample: Sample) -> tuple[Any, ...]:
    return tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)


def stack_collate(samples: Sequence[Sample]) -> Batch:
    """Stack each field of equal-shaped samples into one tensor (B, ...)."""
    columns = list(zip(*(_fields(s) for s in samples)))
    out = []
    for i, column in enumerate(columns):
        if all(isinstance(v, torch.Tensor) for v in column):
            shapes = {tuple(v.shape) for v in column}
            stacked = torch.stack(column) if len(shapes) == 1 else None
        else:
            arrays = [np.asarray(v) for v in column]
            shapes = {a.shape for a in arrays}
            stacked = torch.from_numpy(np.stack(arrays)) if len(shapes) == 1 else None
        if stacked is None:
            a, b = sorted(shapes)[:2]
            raise DataError(
                f"field {i}: samples of one batch have different shapes {a} and {b}; "
                "pass collate=phalanx.data.pad_collate or your own collate"
            )
        out.append(stacked)
    return tuple(out)


def pad_collate(samples: Sequence[Sample], value: float = 0) -> Batch:
    """``stack_collate`` with each field padded with ``value`` to the batch's largest size."""
    columns = list(zip(*(_fields(s) for s in samples)))
    out = []
    for column in columns:
        tensors = [torch.as_tensor(np.asarray(v)) for v in column]
        shape = [max(t.shape[d] for t in tensors) for d in range(tensors[0].dim())]
        batch = torch.full((len(tensors), *shape), value, dtype=tensors[0].dtype)
        for row, t in zip(batch, tensors):
            row[tuple(slice(0, n) for n in t.shape)] = t
        out.append(batch)
    return tuple(out)


def as_batch(value: Any) -> Batch:
    """A preprocess result as a tuple of tensors (numpy arrays are wrapped without a copy)."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    return tuple(
        v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v)) for v in items
    )


# -- readers ---------------------------------------------------------------------------------------
class ArrayReader:
    """In-memory arrays (N, ...) with equal N; ``read`` gathers rows (a copy)."""

    def __init__(self, arrays: Sequence[Any], name: str = "arrays") -> None:
        self.tensors = tuple(_tensor(a) for a in arrays)
        lengths = {len(t) for t in self.tensors}
        if len(lengths) != 1:
            raise DataError(f"source: arrays have different lengths {sorted(lengths)}")
        self.name = name

    def __len__(self) -> int:
        return len(self.tensors[0])

    def read(self, indices: np.ndarray) -> Batch:
        index = torch.from_numpy(indices)
        return tuple(t[index] for t in self.tensors)


class MapReader:
    """A map-style dataset: ``collate([dataset[i] for i in indices])``."""

    def __init__(self, dataset: Any, collate: Collate | None = None) -> None:
        self.dataset = dataset
        self.collate = collate or stack_collate
        self.name = f"dataset {type(dataset).__name__}"

    def __len__(self) -> int:
        return len(self.dataset)

    def read(self, indices: np.ndarray) -> Batch:
        return self.collate([self.dataset[int(i)] for i in indices])


class StoreReader:
    """A record store: fixed records are decoded a batch at a time; variable ones collated."""

    def __init__(self, store: RecordStore, collate: Collate | None = None) -> None:
        self.store = store
        self.collate = collate
        self.name = f"record store {store.path}"

    def __len__(self) -> int:
        return len(self.store)

    def read(self, indices: np.ndarray) -> Batch:
        if self.collate is None and self.store.record_dtype is not None:
            arrays = self.store.read_batch(indices, _torch_empty)
            return tuple(torch.from_numpy(a) for a in arrays)
        return (self.collate or stack_collate)([self.store[int(i)] for i in indices])

    def close(self) -> None:
        self.store.close()


def _torch_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Memory from torch's allocator (aligned as torch's kernels expect), seen from numpy."""
    return torch.from_numpy(np.empty(0, dtype)).new_empty(shape).numpy()


def _tensor(array: Any) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array
    array = np.asarray(array)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def as_reader(source: Any, collate: Collate | None = None) -> Reader:
    if hasattr(source, "read") and hasattr(source, "name") and hasattr(source, "__len__"):
        return source  # already a Reader
    if isinstance(source, str) and source in SOURCES and not Path(source).exists():
        source = load_source(DataConfig(source=source))
    if isinstance(source, (str, os.PathLike)):
        return StoreReader(RecordStore(source), collate)
    if isinstance(source, RecordStore):
        return StoreReader(source, collate)
    if isinstance(source, Dataset):
        return ArrayReader((source.x_train, source.y_train), name="training split")
    if isinstance(source, tuple) and source and all(_is_array(a) for a in source):
        return ArrayReader(source)
    if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        return MapReader(source, collate)
    raise DataError(
        f"source: got a {type(source).__name__}; expected a record store directory, a built-in "
        f"source ({', '.join(SOURCES.names())}), a tuple of arrays, or a map-style dataset"
    )


def _is_array(value: Any) -> bool:
    return isinstance(value, (np.ndarray, torch.Tensor))


def training_reader(path: str, dataset: Dataset) -> Reader:
    """The trainer's reader: the store at ``path`` (inputs, targets) or ``dataset``'s split."""
    if not path:
        return as_reader(dataset)
    reader = StoreReader(RecordStore(path))
    names = [f.name for f in reader.store.fields]
    if len(names) != 2:
        fields = ", ".join(names)
        raise DataError(
            f"data.path: {path} has fields ({fields}); training needs two (inputs, targets)"
        )
    return reader
