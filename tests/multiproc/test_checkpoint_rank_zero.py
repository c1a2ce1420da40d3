"""Replicated state in a checkpoint is rank 0's, as DDP's rank-0 ``torch.save`` writes it: a
BatchNorm model whose ranks see different data and keep their own statistics
(``broadcast_buffers = false``; by default every rank holds rank 0's after each update) ends
a step with different running statistics on every rank; under each strategy the checkpoint
holds rank 0's, and a run resumed from it continues bit for bit as the uninterrupted run
(parameters on every rank, buffers on rank 0: the others resume from rank 0's), at worlds 2
and 3.
Non-tensor state (a MultiStepLR scheduler's Counter of milestones, None placeholders) saves
and restores on several ranks."""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phalanx as px
from phalanx import checkpoint
from tests.helpers.equivalence import copy_state, global_batches, make_engine, train_shards
from tests.helpers.spawn import run_ranks

STRATEGIES = {
    "allreduce": {},
    "tree": {},
    "partitioned": {"schedule": "native"},
    "ps": {"servers": 0, "reduce": "star"},
    "fsdp": {},
}
FIRST, AFTER, LOCAL_BATCH = 2, 2, 4  # steps before the checkpoint, steps after it
ADAM = functools.partial(torch.optim.Adam, lr=0.01)


class BatchNet(nn.Module):
    """Convolutions with BatchNorm: its running statistics follow each rank's own batch."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(6, affine=False)
        self.conv2 = nn.Conv2d(6, 4, 3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(4, affine=False)
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm(self.conv(x)))
        x = torch.relu(self.norm2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's own batches: other data, so other statistics, on every rank."""
    own = global_batches(1, steps=FIRST + AFTER, features=(3, 6, 6), classes=5,
                         local_batch=LOCAL_BATCH, seed=100 + rank)  # fmt: skip
    return [(x * (1 + rank), y) for x, y in own]


def _engine(ctx: px.Context, name: str, seed: int) -> px.Engine:
    torch.manual_seed(seed)
    return make_engine(
        ctx, BatchNet(), ADAM, name, STRATEGIES[name],
        bucket_mb=0.0005,  # several buckets, so several partitions per step
        broadcast_buffers=False,
    )  # fmt: skip


def _buffers(engine: px.Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.named_buffers()}


def _scheduler() -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    return opt, torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[1, 3, 3], gamma=0.5)


def _non_tensors(ctx: px.Context, root: Path) -> dict[str, Any]:
    """A scheduler's state, None saved and None as a placeholder, beside an Engine's."""
    engine = _engine(ctx, "allreduce", 0)
    opt, scheduler = _scheduler()
    for _ in range(2):
        opt.step()
        scheduler.step()
    saved = {"engine": engine, "scheduler": scheduler, "meta": None, "info": {"epoch": 2}}
    checkpoint.save(root / "non-tensors", 2, saved, group=ctx.group)
    _, fresh = _scheduler()
    room = {"engine": _engine(ctx, "allreduce", 1), "scheduler": fresh, "meta": 0, "info": None}
    checkpoint.restore(root / "non-tensors", room, group=ctx.group)
    checkpoint.save(root / "non-tensors-resaved", 3, room, group=ctx.group)  # a resumed state
    checkpoint.restore(root / "non-tensors-resaved", room, group=ctx.group)
    engine.close()
    room["engine"].close()
    return {"expected": scheduler.state_dict(), "restored": fresh.state_dict(),
            "meta": room["meta"], "info": room["info"]}  # fmt: skip


def _save_and_resume(ctx: px.Context, root: Path) -> dict[str, Any]:
    batches = _batches(ctx.rank)
    background = dist.new_group(backend="gloo")  # save_async's collectives: a group of its own
    out: dict[str, Any] = {}
    for name in STRATEGIES:
        engine = _engine(ctx, name, 0)
        train_shards(engine, batches[:FIRST], local_batch=None)
        at_save = _buffers(engine)
        state = {"engine": engine}
        pending = checkpoint.save_async(root / f"{name}-async", FIRST, state, group=background)
        checkpoint.save(root / name, FIRST, {"engine": engine}, group=ctx.group)
        pending.wait()
        train_shards(engine, batches[FIRST:], local_batch=None)
        uninterrupted = copy_state(engine)
        engine.close()
        engine = _engine(ctx, name, 1)  # other weights: everything must come from the checkpoint
        checkpoint.restore(root / name, {"engine": engine}, group=ctx.group)
        train_shards(engine, batches[FIRST:], local_batch=None)
        resumed = copy_state(engine)
        out[name] = {"at_save": at_save, "uninterrupted": uninterrupted, "resumed": resumed}
        engine.close()
    out["non_tensors"] = _non_tensors(ctx, root)
    return out


def _check(results: list[dict[str, Any]], root: Path) -> None:
    world = len(results)
    for name in STRATEGIES:
        zero = results[0][name]["at_save"]
        stats = [k for k in zero if k.endswith(("running_mean", "running_var"))]
        assert (
            len(stats) == 4
            and all(  # the other ranks' statistics differ from rank 0's
                not torch.equal(r[name]["at_save"][k], zero[k]) for r in results[1:] for k in stats
            )
        )
        for saved in (name, f"{name}-async"):
            model = checkpoint.load(root / saved)["engine"]["model"]
            for key, value in zero.items():
                assert torch.equal(model[key], value), f"world {world} {saved}: {key} not rank 0's"
        for rank, r in enumerate(results):
            for key, value in r[name]["uninterrupted"].items():
                if rank and key in zero:  # its own statistics, where the resumed has rank 0's
                    continue
                got = r[name]["resumed"][key]
                assert torch.equal(got, value), f"world {world} {name} rank {rank}: {key} differs"
    for rank, r in enumerate(results):
        got = r["non_tensors"]
        assert got["restored"] == got["expected"], (rank, got)
        assert type(got["restored"]["milestones"]) is Counter, (rank, got)
        assert got["meta"] is None and got["info"] == {"epoch": 2}, (rank, got)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_replicated_state_is_rank_zeros_and_resumes_bit_for_bit(tmp_path: Path, world: int) -> None:
    results = run_ranks(_save_and_resume, world, tmp_path, timeout=300)
    _check(results, tmp_path)
