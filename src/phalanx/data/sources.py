"""Built-in data sources (no downloads): arrays of inputs and labels with a fixed split."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from phalanx.fields import option, require
from phalanx.registry import Registry

SPLIT_SEED = 1234  # the train/validation split never changes with the training seed


@dataclass(frozen=True)
class Dataset:
    """In-memory split on the CPU: x_* (N, ...) float32 or (N, T) int64 token ids; y_* (N,) or
    (N, T) int64."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    num_classes: int


SOURCES: Registry[Dataset] = Registry("data source")


@dataclass(kw_only=True)
class DataConfig:
    """Which data, how it is batched and shuffled."""

    source: str = option("digits", "built-in source name (see phalanx.data.SOURCES)")
    batch_size: int = option(32, "samples per process per step (global batch = this x world)")
    val_fraction: float = option(0.2, "fraction held out for validation (fixed split)")
    seed: int = option(0, "shuffle seed; epoch e uses permutation seed + e")
    shuffle: bool = option(True, "reshuffle the training set every epoch")
    seq_len: int = option(64, "characters per sequence (sequence sources: text)")
    path: str = option("", "record store to train on (phalanx data pack); validation: source")
    io_threads: int = option(1, "input pipeline: threads reading batches")
    workers: int = option(2, "input pipeline: preprocessing threads (also the device copy)")
    buffers: int = option(3, "input pipeline: rotating batch buffers (F3: 2, F10: 3)")

    def __post_init__(self) -> None:
        SOURCES.require_known(self.source, "source", "source")
        require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        require(self.seq_len >= 1, "seq_len", f"must be >= 1, got {self.seq_len}")
        for key in ("io_threads", "workers", "buffers"):
            require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        fraction = self.val_fraction
        require(0.0 < fraction < 1.0, "val_fraction", f"must be in (0, 1), got {fraction}")


def load_source(config: DataConfig) -> Dataset:
    return SOURCES.get(config.source)(config)


def split(x: np.ndarray, y: np.ndarray, val_fraction: float, num_classes: int) -> Dataset:
    """A fixed random split (seeded by SPLIT_SEED) into train and validation tensors."""
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    num_val = int(round(len(x) * val_fraction))
    val, train = order[:num_val], order[num_val:]
    x_train, y_train, x_val, y_val = (torch.from_numpy(a[i]) for i in (train, val) for a in (x, y))
    return Dataset(x_train, y_train, x_val, y_val, num_classes)


@SOURCES.register("digits")
def digits(config: DataConfig) -> Dataset:
    """scikit-learn's bundled handwritten digits: 1797 images (1, 8, 8) in [0, 1], 10 classes."""
    images, target = digits_arrays()
    x = (images.astype(np.float32) / 16.0)[:, None, :, :]
    return split(x, target.astype(np.int64), config.val_fraction, num_classes=10)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 8, 8) float64 in 0..16, labels (1797,)) from sklearn's shipped file,
    without importing sklearn (about 2 s in every process that trains on digits)."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    files = [Path(root, "datasets", "data", "digits.csv.gz") for root in roots]
    found = next((f for f in files if f.is_file()), None)
    if found is None:  # a layout we do not know: the library's own loader
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target
    data = np.loadtxt(found, delimiter=",")  # 64 pixels, then the label, per row
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)


# Fixed character vocabulary of the ``text`` source: 0 = any other character, 1 = newline,
# 2.. = printable ASCII (space to tilde), so ids never depend on the text.
TEXT_VOCAB = "\x00\n" + "".join(chr(c) for c in range(32, 127))


def encode_text(text: str) -> np.ndarray:
    """Character ids (len(text),) int64 in [0, len(TEXT_VOCAB)); unknown characters -> 0."""
    lookup = {ch: i for i, ch in enumerate(TEXT_VOCAB)}
    return np.fromiter((lookup.get(ch, 0) for ch in text), dtype=np.int64, count=len(text))


@SOURCES.register("text")
def text(config: DataConfig) -> Dataset:
    """Characters of Python's help texts (``pydoc_data.topics``, sorted) in windows of
    seq_len + 1: x (N, seq_len) int64 the first seq_len ids, y the same shifted by one."""
    from pydoc_data.topics import topics

    ids = encode_text("\n\n".join(topics[key] for key in sorted(topics)))
    n = (len(ids) - 1) // config.seq_len
    windows = np.lib.stride_tricks.sliding_window_view(ids, config.seq_len + 1)
    windows = windows[: n * config.seq_len : config.seq_len]
    x, y = windows[:, :-1].copy(), windows[:, 1:].copy()
    return split(x, y, config.val_fraction, num_classes=len(TEXT_VOCAB))
