"""Engine data parallelism on Gloo equals single-process training on the same global batch.

Each spawned run does many checks (spawning costs seconds). Every rank also computes the
single-process reference locally with plain torch, so no second spawn is needed.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import phalanx as px
from tests.helpers.spawn import RankFailed, run_ranks

STEPS = 6
LOCAL_BATCH = 8


class ReversedNet(nn.Module):
    """Layers registered in the reverse of their use, so backward order != reverse registration
    and the Engine must rebuild its buckets from the observed order."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(32, 10)
        self.mid = nn.Linear(64, 32)
        self.stem = nn.Linear(20, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(torch.relu(self.stem(x)))))


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


def _batches(world: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    n = LOCAL_BATCH * world
    return [
        (torch.randn(n, 20, generator=g), torch.randint(0, 10, (n,), generator=g))
        for _ in range(STEPS)
    ]


def _shard(t: torch.Tensor, ctx: px.Context) -> torch.Tensor:
    return t[ctx.rank * LOCAL_BATCH : (ctx.rank + 1) * LOCAL_BATCH]


def _reference(model: nn.Module, factory, batches, accumulate: int = 1) -> nn.Module:
    """Plain single-process training on the global batches."""
    model = copy.deepcopy(model)
    opt = factory([p for p in model.parameters() if p.requires_grad])
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        for xc, yc in zip(torch.chunk(x, accumulate), torch.chunk(y, accumulate)):
            (nn.functional.cross_entropy(model(xc), yc) / accumulate).backward()
        opt.step()
    return model


def _train(ctx: px.Context, model: nn.Module, factory, batches, **engine_kwargs) -> px.Engine:
    engine = px.Engine(
        copy.deepcopy(model), nn.functional.cross_entropy, factory, context=ctx, **engine_kwargs
    )
    for x, y in batches:
        engine.step(_shard(x, ctx), _shard(y, ctx))
    return engine


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=0.01)


def _equivalence_checks(ctx: px.Context) -> dict:
    torch.manual_seed(0)
    model = ReversedNet()
    batches = _batches(ctx.world_size)
    out: dict = {}
    for name, factory in (("sgd", SGD), ("adam", ADAM)):
        # ~1 KB buckets: >= 3 buckets, so some launch while backward still runs.
        engine = _train(ctx, model, factory, batches, bucket_mb=0.004)
        out[f"{name}_diff"] = _max_diff(engine.module, _reference(model, factory, batches))
        out[f"{name}_params"] = [p.detach().clone() for p in engine.module.parameters()]
        out["num_buckets"] = engine.stats.num_buckets
        out["launched_in_backward"] = engine.stats.buckets_launched_in_backward
        out["first_bucket_pending"] = engine.buckets.buckets[0].pending_grads_at_launch
        out["bytes_sent"] = engine.stats.bytes_sent
    # Gradient accumulation over 4 micro-steps equals the big batch.
    engine = _train(ctx, model, SGD, batches, accumulate_steps=4)
    out["accumulate_diff"] = _max_diff(engine.module, _reference(model, SGD, batches))
    # Frozen parameters stay frozen and the rest still matches.
    frozen = copy.deepcopy(model)
    frozen.stem.weight.requires_grad_(False)
    engine = _train(ctx, frozen, ADAM, batches, bucket_mb=0.004)
    out["frozen_diff"] = _max_diff(engine.module, _reference(frozen, ADAM, batches))
    out["frozen_unchanged"] = torch.equal(engine.module.stem.weight, model.stem.weight)
    return out


def _branch_checks(ctx: px.Context) -> dict:
    torch.manual_seed(0)
    model = BranchNet()
    batches = _batches(ctx.world_size, seed=1)
    # Make the "sometimes" branch fire on rank 0 only: rank 0's first sample positive.
    for x, _ in batches:
        x[0::LOCAL_BATCH, 0] = -1.0
        x[0, 0] = 1.0
    engine = _train(ctx, model, ADAM, batches, bucket_mb=0.0005)
    return {
        "never_unchanged": torch.equal(engine.module.never.weight, model.never.weight),
        "never_grad_is_none": engine.module.never.weight.grad is None,
        "params": [p.detach().clone() for p in engine.module.parameters()],
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
