"""Evaluation that leaves every submodule's train/eval mode as it found it (a script may keep
a frozen BatchNorm in eval mode; the Engine never sets modes)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def evaluating(module: torch.nn.Module) -> Iterator[None]:
    """``module.eval()`` inside the block; each submodule's own mode restored after it."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.train(training)
