"""Small models several test modules train."""

from __future__ import annotations

import torch
from torch import nn


class Reversed(nn.Module):
    """Layers registered in the reverse of their use: the observed backward order differs from
    the registration order, so the buckets rebuild after the first update."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 3)
        self.stem = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.stem(x)))


def batch(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded batch of ``Reversed``'s shapes: ``rows`` inputs of 4 features, labels below 3."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, 4, generator=g), torch.randint(0, 3, (rows,), generator=g)
