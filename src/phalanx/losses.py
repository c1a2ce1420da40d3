"""The loss of runs built from a config (``phalanx train``, ``profile``, ``plan``, the pool)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the last dim: logits (B, C) or (B, T, C), any float dtype; int64
    targets (B,) or (B, T) on the same device; a 0-dim mean."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
