"""Evaluation that leaves the model's train/eval modes as it found them.

The Engine never sets modes itself (a script may keep a submodule in eval mode, e.g. a frozen
BatchNorm, as in a plain loop or under DDP), so whatever evaluates in between steps must put
every submodule back as it was.
"""

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
