"""A fine-tuning script as people write it: ``finetune.py OUT_DIR STRATEGY MODE``.

The BatchNorm is frozen with ``bn.eval()`` once, before the loop; AdamW has decay / no-decay
groups; rank 0 saves. MODE ``ported``: the loop is ``engine.step`` only; ``leftover``: the
DDP loop's ``optimizer.step()`` is still there after it (a mistake: it must fail in one line,
not update twice). ``reference`` is the same script in one process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import phalanx as px

STEPS, GLOBAL_BATCH = 4, 12


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model[1].eval()  # frozen statistics: the pretrained ones are kept
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups, lr=0.01)


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = (
        torch.randn(GLOBAL_BATCH, 8, generator=g),
        torch.randint(0, 3, (GLOBAL_BATCH,), generator=g),
    )
    per = GLOBAL_BATCH // world_size
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def reference() -> dict[str, torch.Tensor]:
    model, optimizer = build()
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(batch(step, 0, 1)[0]), batch(step, 0, 1)[1]).backward()
        optimizer.step()
    return model.state_dict()


def main() -> None:
    out, strategy, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    ctx = px.init()
    model, optimizer = build()
    engine = px.Engine(model, nn.functional.cross_entropy, optimizer, exchange=strategy)
    for step in range(STEPS):
        engine.step(*batch(step, ctx.rank, ctx.world_size))
        if mode == "leftover":
            optimizer.step()
    if ctx.rank == 0:
        torch.save(model.state_dict(), out / f"{strategy}.pt")


if __name__ == "__main__":
    main()
