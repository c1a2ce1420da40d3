"""A script whose ranks run different numbers of steps (uneven data, no drop_last), a common
mistake: ``uneven.py STRATEGY``. Rank 0 runs one step more than the others."""

from __future__ import annotations

import sys

import torch
from torch import nn

import phalanx as px


def main() -> None:
    ctx = px.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = px.Engine(model, nn.functional.mse_loss, optimizer, exchange=sys.argv[1])
    for _ in range(5 if ctx.rank == 0 else 4):
        engine.step(torch.randn(8, 16), torch.randn(8, 4))


if __name__ == "__main__":
    main()
