"""Gradient clipping by the global norm: N ranks equal one process with
torch.nn.utils.clip_grad_norm_ on the same global batch, for every strategy that can clip
(sharded ones sum their owners' squares in one small all-reduce), with fp16 compression too."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.memory.manager import MemoryConfig, MemoryManager
from tests.helpers.spawn import run_ranks

STEPS, LOCAL_BATCH, MAX_NORM = 4, 4, 0.05
SGD = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)
CASES = [
    ("allreduce", {}, None, ""),
    ("tree", {}, None, ""),
    ("partitioned", {}, None, ""),
    ("partitioned", {"schedule": "native"}, None, ""),
    ("allreduce", {}, "fp16", ""),
    ("partitioned", {}, "fp16", ""),
    # the host mirror (F19): gradients copied as each bucket's exchange ends, then clipped
    ("allreduce", {}, None, "mirror"),
    ("tree", {}, None, "mirror"),
    ("allreduce", {}, "fp16", "mirror"),
    ("partitioned", {}, None, "mirror"),
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))  # fmt: skip


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    n = LOCAL_BATCH * world
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
            for _ in range(STEPS)]  # fmt: skip


def _reference(batches: list) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = _model()
    opt = SGD(model.parameters())
    norms = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
    return model.state_dict(), norms


def _clipped(ctx: px.Context) -> dict:
    out = {}
    batches = _batches(ctx.world_size)
    for strategy, options, compress, place in CASES:
        memory = None
        if place:
            config = MemoryConfig(optimizer=place, optimizer_chunk_mb=0.001)
            memory = MemoryManager.build([], config, ctx.device)
        engine = px.Engine(
            copy.deepcopy(_model()), nn.functional.cross_entropy, SGD, context=ctx,
            exchange=px.exchange.strategy_factory(strategy, options), compress=compress,
            max_grad_norm=MAX_NORM, bucket_mb=0.001, first_bucket_mb=0.0005, memory=memory,
        )  # fmt: skip
        norms = []
        for x, y in batches:
            lo = ctx.rank * LOCAL_BATCH
            engine.step(x[lo : lo + LOCAL_BATCH], y[lo : lo + LOCAL_BATCH])
            norms.append(engine.stats.grad_norm)
        key = f"{strategy}-{options.get('schedule', '')}-{compress}-{place}"
        out[key] = {"state": engine.module.state_dict(), "norms": norms}
        if place:  # the replicated strategies' gradients went to the host as buckets ended
            out[key]["early"] = engine.memory.mirror.num_early_copies
        engine.close()
    try:
        px.Engine(_model(), nn.functional.cross_entropy, SGD, exchange="ps", max_grad_norm=1.0,
                  context=ctx)  # fmt: skip
        out["ps"] = "accepted"
    except px.ConfigError as e:
        out["ps"] = str(e)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_clipping_equals_one_process(world_size: int) -> None:
    results = run_ranks(_clipped, world_size, timeout=240)
    expected, norms = _reference(_batches(world_size))
    assert min(norms) > MAX_NORM  # clipping acts on every step
    for rank, result in enumerate(results):
        for key in [k for k in result if k != "ps"]:
            tolerance = 2e-3 if "fp16" in key else 1e-5
            if key.endswith("mirror"):
                early = result[key]["early"]
                assert early > 0 if not key.startswith("partitioned") else early == 0, key
            assert result[key]["norms"] == pytest.approx(norms, rel=10 * tolerance), (key, rank)
            for name, value in expected.items():
                torch.testing.assert_close(
                    result[key]["state"][name], value, atol=tolerance, rtol=0,
                    msg=lambda m, k=key, r=rank, n=name: f"{k} rank {r} {n}: {m}",
                )  # fmt: skip
        assert result["ps"].startswith("max_grad_norm: ParameterServer updates parameters")
