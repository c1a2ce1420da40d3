"""Built-in data sources (no downloads): arrays of inputs and labels with a fixed split."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from phalanx.fields import option, require
from phalanx.registry import Registry

SPLIT_SEED = 1234  # the train/validation split never changes with the training seed


@dataclass(frozen=True)
class Dataset:
    """In-memory split: x_* (N, ...) float32, y_* (N,) int64, both on the CPU."""

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

    def __post_init__(self) -> None:
        require(
            self.source in SOURCES,
            "source",
            f"unknown source {self.source!r}; known: {', '.join(SOURCES.names())}",
        )
        require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        require(
            0.0 < self.val_fraction < 1.0,
            "val_fraction",
            f"must be in (0, 1), got {self.val_fraction}",
        )


def load_source(config: DataConfig) -> Dataset:
    return SOURCES.get(config.source)(config.val_fraction)


def split(x: np.ndarray, y: np.ndarray, val_fraction: float, num_classes: int) -> Dataset:
    """A fixed random split (seeded by SPLIT_SEED) into train and validation tensors."""
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    num_val = int(round(len(x) * val_fraction))
    val, train = order[:num_val], order[num_val:]
    return Dataset(
        x_train=torch.from_numpy(x[train]),
        y_train=torch.from_numpy(y[train]),
        x_val=torch.from_numpy(x[val]),
        y_val=torch.from_numpy(y[val]),
        num_classes=num_classes,
    )


def _register(name: str) -> Callable[[Callable[[float], Dataset]], Callable[[float], Dataset]]:
    return SOURCES.register(name)


@_register("digits")
def digits(val_fraction: float) -> Dataset:
    """scikit-learn's bundled handwritten digits: 1797 images (1, 8, 8) in [0, 1], 10 classes."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]
    return split(x, bunch.target.astype(np.int64), val_fraction, num_classes=10)
