"""A script saving its optimizer's state the nanoGPT way: ``optimizer_state.py OUT_DIR MODE``.

MODE ``every``: every rank asks ``engine.optimizer_state_dict()`` (a collective under
``partitioned``), rank 0 saves; ``rank0``: only rank 0 asks (a mistake: it must fail in one
clear line, not hang)."""

from __future__ import annotations

import sys

import torch
from torch import nn
from user_model import build_model, shard

import phalanx as px


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    ctx = px.init()
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    engine = px.Engine(model, nn.functional.cross_entropy, optimizer, exchange="partitioned")
    for step in range(3):
        engine.step(*shard(step, ctx.rank, ctx.world_size))
    if mode == "every" or ctx.rank == 0:
        state = engine.optimizer_state_dict()
        if ctx.rank == 0:
            torch.save(state, f"{out}/optimizer.pt")


if __name__ == "__main__":
    main()
