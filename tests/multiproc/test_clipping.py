"""Gradient clipping by the global norm: N ranks equal one process with
torch.nn.utils.clip_grad_norm_ on the same global batch, for every strategy that can clip
(sharded ones sum their owners' squares in one small all-reduce), with fp16 compression too."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import phalanx as px
from tests.helpers.equivalence import (
    assert_states_close,
    global_batches,
    host_memory,
    make_engine,
    one_process,
    train_shards,
)
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
    return global_batches(world, steps=STEPS, features=6, classes=3, local_batch=LOCAL_BATCH)


def _clipped(ctx: px.Context) -> dict:
    out = {}
    batches = _batches(ctx.world_size)
    for strategy, options, compress, place in CASES:
        engine = make_engine(
            ctx, _model(), SGD, strategy, options, compress=compress, max_grad_norm=MAX_NORM,
            bucket_mb=0.001, first_bucket_mb=0.0005, memory=host_memory(ctx, place, 0.001),
        )  # fmt: skip
        norms = train_shards(engine, batches, local_batch=LOCAL_BATCH, sync=False,
                             observe=lambda e: e.stats.grad_norm)  # fmt: skip
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
    reference = one_process(_model(), SGD, _batches(world_size), max_grad_norm=MAX_NORM)
    expected, norms = reference.state(), reference.grad_norms
    assert min(norms) > MAX_NORM  # clipping acts on every step
    for rank, result in enumerate(results):
        for key in [k for k in result if k != "ps"]:
            tolerance = 2e-3 if "fp16" in key else 1e-5
            if key.endswith("mirror"):
                early = result[key]["early"]
                assert early > 0 if not key.startswith("partitioned") else early == 0, key
            assert result[key]["norms"] == pytest.approx(norms, rel=10 * tolerance), (key, rank)
            state = result[key]["state"]
            assert_states_close(state, expected, atol=tolerance, rtol=0, what=f"{key} rank {rank}")
        assert result["ps"].startswith("max_grad_norm: ParameterServer updates parameters")
