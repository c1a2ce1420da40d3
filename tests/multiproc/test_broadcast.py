"""Start-up and per-step state broadcasts are one collective each, whatever the dtypes, and
every rank ends up with rank 0's values."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

import phalanx as px
from tests.helpers.spawn import run_ranks


class Mixed(nn.Module):
    """fp32 parameters, BatchNorm's fp32 and int64 buffers, an fp16 and a bool buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 7)
        self.norm = nn.BatchNorm1d(7)
        self.register_buffer("scale16", torch.randn(3).half())
        self.register_buffer("mask", torch.rand(4) > 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def _count_broadcasts(ctx: px.Context) -> dict:
    torch.manual_seed(ctx.rank)  # every rank starts different
    model = Mixed()
    calls = []
    original = dist.broadcast

    def counting(tensor: torch.Tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.broadcast = counting
    try:
        engine = px.Engine(model, nn.functional.cross_entropy,
                           functools.partial(torch.optim.SGD, lr=0.1), context=ctx)  # fmt: skip
        at_init = len(calls)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        g = torch.Generator().manual_seed(ctx.rank)
        batch = torch.randn(6, 5, generator=g), torch.randint(0, 7, (6,), generator=g)
        engine.step(*batch)  # the first step also agrees on the bucket order (one more)
        before = len(calls)
        engine.step(*batch)
        per_step = len(calls) - before
    finally:
        dist.broadcast = original
    engine.close()
    return {"at_init": at_init, "per_step": per_step, "state": state}


def test_one_broadcast_at_start_and_one_per_step() -> None:
    results = run_ranks(_count_broadcasts, 2)
    torch.manual_seed(0)
    rank0 = Mixed().state_dict()
    for result in results:
        assert result["at_init"] == 1 and result["per_step"] == 1
        for name, value in rank0.items():
            assert torch.equal(result["state"][name], value), name
