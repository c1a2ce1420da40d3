"""Engine data parallelism on Gloo equals single-process training on the same global batch.

Each spawned run does many checks (spawning costs seconds). Every rank also computes the
single-process reference locally with plain torch, so no second spawn is needed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import phalanx as px
from tests.helpers.equivalence import (
    ADAM,
    LOCAL_BATCH,
    SGD,
    ReversedNet,
    copy_params,
    global_batches,
    make_engine,
    max_diff,
    one_process,
    train_shards,
)
from tests.helpers.spawn import RankFailed, run_ranks


class BranchNet(nn.Module):
    """``never`` is unused everywhere; ``rank0_only`` is used only when x.sum() > 0."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(20, 10)
        self.never = nn.Linear(20, 10)
        self.sometimes = nn.Linear(20, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        if float(x[0, 0]) > 0:
            out = out + self.sometimes(x)
        return out


def _trained(ctx: px.Context, model: nn.Module, factory, batches, **engine_kwargs) -> px.Engine:
    """An Engine on ``model`` trained on this rank's rows of ``batches``, not synced: reading
    ``engine.module`` must wait by itself."""
    engine = make_engine(ctx, model, factory, **engine_kwargs)
    train_shards(engine, batches, sync=False)
    return engine


def _equivalence_checks(ctx: px.Context) -> dict:
    torch.manual_seed(0)
    model = ReversedNet()
    batches = global_batches(ctx.world_size)
    out: dict = {}
    for name, factory in (("sgd", SGD), ("adam", ADAM)):
        # ~1 KB buckets: >= 3 buckets, so some launch while backward still runs.
        engine = _trained(ctx, model, factory, batches, bucket_mb=0.004)
        out[f"{name}_diff"] = max_diff(engine.module, one_process(model, factory, batches).model)
        out[f"{name}_params"] = copy_params(engine.module)
        out["num_buckets"] = engine.stats.num_buckets
        out["launched_in_backward"] = engine.stats.buckets_launched_in_backward
        out["first_bucket_pending"] = engine.buckets.buckets[0].pending_grads_at_launch
        out["bytes_sent"] = engine.stats.bytes_sent
    # Gradient accumulation over 4 micro-steps equals the big batch.
    engine = _trained(ctx, model, SGD, batches, accumulate_steps=4)
    out["accumulate_diff"] = max_diff(engine.module, one_process(model, SGD, batches).model)
    # Frozen parameters stay frozen and the rest still matches.
    frozen = copy.deepcopy(model)
    frozen.stem.weight.requires_grad_(False)
    engine = _trained(ctx, frozen, ADAM, batches, bucket_mb=0.004)
    out["frozen_diff"] = max_diff(engine.module, one_process(frozen, ADAM, batches).model)
    out["frozen_unchanged"] = torch.equal(engine.module.stem.weight, model.stem.weight)
    return out


def _branch_checks(ctx: px.Context) -> dict:
    torch.manual_seed(0)
    model = BranchNet()
    batches = global_batches(ctx.world_size, seed=1)
    # Make the "sometimes" branch fire on rank 0 only: rank 0's first sample positive.
    for x, _ in batches:
        x[0::LOCAL_BATCH, 0] = -1.0
        x[0, 0] = 1.0
    engine = _trained(ctx, model, ADAM, batches, bucket_mb=0.0005)
    return {
        "never_unchanged": torch.equal(engine.module.never.weight, model.never.weight),
        "never_grad_is_none": engine.module.never.weight.grad is None,
        "params": copy_params(engine.module),
    }


def _broadcast_check(ctx: px.Context) -> dict:
    torch.manual_seed(ctx.rank)  # different initial weights on every rank
    engine = px.Engine(nn.Linear(4, 2), nn.functional.cross_entropy, SGD, context=ctx)
    return {"weight": engine.module.weight.detach().clone()}


def _all_checks(ctx: px.Context) -> dict:
    return {
        "equivalence": _equivalence_checks(ctx),
        "branch": _branch_checks(ctx),
        "broadcast": _broadcast_check(ctx),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_engine_matches_single_process(world_size: int) -> None:
    results = run_ranks(_all_checks, world_size)
    for rank, r in enumerate(results):
        eq = r["equivalence"]
        assert eq["sgd_diff"] < 1e-5, f"rank {rank}: SGD differs by {eq['sgd_diff']}"
        assert eq["adam_diff"] < 1e-5, f"rank {rank}: Adam differs by {eq['adam_diff']}"
        assert eq["accumulate_diff"] < 1e-5, f"rank {rank}: accumulation {eq['accumulate_diff']}"
        assert eq["frozen_diff"] < 1e-5 and eq["frozen_unchanged"], f"rank {rank}: frozen"
        # Overlap: >= 3 buckets and the first launched while other gradients were pending.
        assert eq["num_buckets"] >= 3
        assert eq["launched_in_backward"] >= 2
        assert eq["first_bucket_pending"] > 0
        assert eq["bytes_sent"] > 0
        assert r["branch"]["never_unchanged"] and r["branch"]["never_grad_is_none"]
    for r in results[1:]:  # replicas agree bit for bit
        for a, b in zip(r["branch"]["params"], results[0]["branch"]["params"]):
            assert torch.equal(a, b)
        for a, b in zip(r["equivalence"]["adam_params"], results[0]["equivalence"]["adam_params"]):
            assert torch.equal(a, b)
        assert torch.equal(r["broadcast"]["weight"], results[0]["broadcast"]["weight"])


def _raise_on_rank_1(ctx: px.Context) -> None:
    if ctx.rank == 1:
        raise ValueError("boom on purpose")
    ctx.barrier()  # rank 0 would wait forever for rank 1 without the harness's teardown


def test_harness_names_the_failing_rank() -> None:
    with pytest.raises(RankFailed, match=r"rank 1 failed(.|\n)*boom on purpose"):
        run_ranks(_raise_on_rank_1, 2, timeout=60)
