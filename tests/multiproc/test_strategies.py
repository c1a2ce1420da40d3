"""Every exchange strategy gives the same parameters as ``allreduce`` (world sizes 2, 3, 4;
SGD, Adam, AdaGrad) and holds ~1/p of the optimizer state where it shards it (checkpoints
that resume under another world size and strategy: test_checkpoints.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.optim import AdaGrad
from tests.helpers.equivalence import (
    ADAM,
    LOCAL_BATCH,
    SGD,
    ReversedNet,
    copy_params,
    global_batches,
    host_memory,
    make_engine,
    max_diff,
    one_process,
    train_shards,
)
from tests.helpers.spawn import run_ranks

OPTIMIZERS = {"sgd": SGD, "adam": ADAM, "adagrad": functools.partial(AdaGrad, lr=0.05)}
STRATEGIES = [
    ("tree", {}),
    ("partitioned", {"schedule": "cyclic"}),
    ("partitioned", {"schedule": "native"}),
    ("ps", {"servers": 0, "reduce": "star"}),
    ("ps", {"servers": 0, "reduce": "tree"}),
    ("ps", {"servers": 1, "reduce": "star"}),
    ("ps", {"servers": 1, "reduce": "tree"}),
]
STRATEGY_LIST = [("allreduce", {}), *STRATEGIES]


def _compare_all(ctx: px.Context) -> dict:
    torch.manual_seed(0)
    model = ReversedNet()
    batches = global_batches(ctx.world_size)
    out: dict = {"diffs": {}, "optimizer_bytes": {}}
    runs = [(o, f, n, s, "") for o, f in OPTIMIZERS.items() for n, s in STRATEGY_LIST]
    for place in ("stream", "mirror"):
        runs += [("adam", OPTIMIZERS["adam"], n, s, place) for n, s in STRATEGY_LIST]
    for opt_name, factory, name, options, host in runs:
        # F19 in small chunks: state in a spill file (stream), or on the host (mirror);
        # several buckets, so several partitions per step
        memory = host_memory(ctx, host, chunk_mb=0.002)
        engine = make_engine(ctx, model, factory, name, options, bucket_mb=0.004, memory=memory)
        workers = engine.data_world_size
        # the global batch of the workers (ps servers shrink it)
        trained_on = [(x[: LOCAL_BATCH * workers], y[: LOCAL_BATCH * workers]) for x, y in batches]
        train_shards(engine, trained_on)
        key = f"{name}{options}/{opt_name}" + (f" {host}" if host else "")
        if opt_name == "adam":
            out["optimizer_bytes"][key] = engine.optimizer_bytes()
        if engine.is_trainer:
            # Compare with allreduce on the same global batch.
            ref = one_process(model, factory, trained_on).model
            out["diffs"][key] = max_diff(copy_params(engine.module), ref)
        out.setdefault("bytes", {})[key] = (
            engine.stats.bytes_sent,
            engine.stats.bytes_received,
        )
        if host and engine.optimizer_bytes() > 0:  # this rank holds state (ps: its servers)
            mirror = engine.memory.mirror
            out.setdefault("mirror", {})[key] = (mirror.stored_bytes(), mirror.num_chunks_stepped)
            # the bucket rebuild after step 1 takes the state out only for sharded owners
            out.setdefault("resident", {})[key] = mirror.num_resident
        engine.close()
    out["tree_fp16"] = _tree_fp16(ctx, model, batches)
    return out


def _tree_fp16(ctx: px.Context, model: nn.Module, batches: list) -> dict:
    """``tree`` with fp16: the root encodes the sum once, every rank below passes it on (at 4
    ranks rank 2 forwards to rank 3), so every replica decodes the same bytes."""
    engine = make_engine(ctx, model, SGD, exchange="tree", compress="fp16", bucket_mb=0.004)
    train_shards(engine, batches)
    ref = one_process(model, SGD, batches).model
    params = copy_params(engine.module)
    engine.close()
    return {"diff": max_diff(params, ref), "params": params}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_strategies_equal_allreduce(world_size: int) -> None:
    results = run_ranks(_compare_all, world_size, timeout=240)
    for rank, r in enumerate(results):
        for key, diff in r["diffs"].items():
            assert diff < 2e-5, f"world {world_size} rank {rank} {key}: max diff {diff}"
        expected = (len(OPTIMIZERS) + 2) * (1 + len(STRATEGIES))
        assert len(r["diffs"]) >= expected - (len(OPTIMIZERS) + 2) * 2  # ps servers=1 skip
        for key, (stored, chunks) in r["mirror"].items():  # the state really went to the tier
            assert stored > 0 and chunks > 1, (rank, key, stored, chunks)
        for key, entered in r["resident"].items():
            sharded = key.startswith(("partitioned", "ps"))
            assert (entered > 0) == sharded, (rank, key, entered)
        for key, (sent, received) in r["bytes"].items():
            if "servers': 1" not in key:
                assert sent > 0 or received > 0 or world_size == 1, key
        assert r["tree_fp16"]["diff"] < 1e-3, (rank, r["tree_fp16"]["diff"])
        for a, b in zip(r["tree_fp16"]["params"], results[0]["tree_fp16"]["params"]):
            assert torch.equal(a, b), f"world {world_size} rank {rank} tree fp16: replicas differ"
    # Optimizer state: plain data parallel keeps it all on every rank; native partitioning
    # keeps about 1/p on each rank, and the shards add up to the whole.
    full = results[0]["optimizer_bytes"]["allreduce{}/adam"]
    native = [r["optimizer_bytes"]["partitioned{'schedule': 'native'}/adam"] for r in results]
    assert all(b <= full / world_size * 1.05 + 64 for b in native), (native, full)
    assert abs(sum(native) - full) <= 64 * world_size, (native, full)
