"""A script that rolls back to a snapshot after a loss spike, as people write it:
``rollback.py OUT_DIR STRATEGY``.

It keeps ``model.state_dict()`` from a good step and, when the (simulated) spike comes, calls
``model.load_state_dict(snapshot)`` right after ``engine.step()`` returned -- while
``partitioned`` and ``ps`` may still be sending that step's parameters back. Training then
goes on; rank 0 saves the final weights. ``reference`` is the same script in one process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import phalanx as px

STEPS, GOOD, SPIKE = 5, 1, 2  # snapshot after step GOOD, roll back after step SPIKE
GLOBAL_BATCH, WIDTH = 12, 512


def build_model() -> nn.Module:
    """Big enough (1.3 M parameters) that the send-back is still in flight when a rank
    returns from step()."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 64))  # fmt: skip


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL_BATCH, 64, generator=g), torch.randn(GLOBAL_BATCH, 64, generator=g)
    per = GLOBAL_BATCH // world_size
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train(step_fn, model: nn.Module, rank: int, world_size: int) -> None:
    snapshot = None
    for step in range(STEPS):
        step_fn(*batch(step, rank, world_size))
        if step == GOOD:
            snapshot = {k: v.clone() for k, v in model.state_dict().items()}
        if step == SPIKE:  # the loss spiked: back to the last good weights
            model.load_state_dict(snapshot)


def reference() -> dict[str, torch.Tensor]:
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    train(step_fn, model, 0, 1)
    return model.state_dict()


def main() -> None:
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    ctx = px.init()
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    engine = px.Engine(model, nn.functional.mse_loss, optimizer, exchange=strategy)
    train(engine.step, model, ctx.rank, ctx.world_size)
    if ctx.rank == 0:
        torch.save(model.state_dict(), out / f"{strategy}.pt")


if __name__ == "__main__":
    main()
