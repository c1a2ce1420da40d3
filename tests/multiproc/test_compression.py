"""Compressed exchange on Gloo: every strategy stays close to exact training with identical
replicas, digits accuracy stays within a point, and gradient bytes on the wire halve."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.data.sources import DataConfig, load_source
from phalanx.models.zoo import digits_cnn
from tests.helpers.equivalence import (
    SGD,
    ReversedNet,
    copy_params,
    global_batches,
    make_engine,
    max_diff,
    one_process,
    train_shards,
)
from tests.helpers.spawn import run_ranks

STRATEGIES = [
    ("allreduce", {}),
    ("tree", {}),
    ("partitioned", {"schedule": "native"}),
    ("partitioned", {"schedule": "cyclic"}),
    ("ps", {"servers": 0}),
]


def _strategies_fp16(ctx: px.Context) -> dict:
    torch.manual_seed(0)
    model, batches = ReversedNet(), global_batches(ctx.world_size)
    reference = one_process(model, SGD, batches).model
    out = {}
    for name, options in STRATEGIES:
        engine = make_engine(ctx, model, SGD, name, options, bucket_mb=0.004, compress="fp16")
        train_shards(engine, batches)
        params = copy_params(engine.module)
        diff = max_diff(params, reference)
        out[f"{name}{options}"] = {"diff": diff, "params": params}
        engine.close()
    return out


def _digits_accuracy(ctx: px.Context, compress: str, steps: int = 240) -> dict:
    torch.manual_seed(0)
    data = load_source(DataConfig())
    engine = px.Engine(
        digits_cnn(dropout=0.0), nn.functional.cross_entropy,
        functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9), compress=compress, context=ctx,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    global_batch = 32 * ctx.world_size
    sent = []
    for _ in range(steps):
        index = torch.randint(0, len(data.x_train), (global_batch,), generator=g)
        mine = index[ctx.rank * 32 : (ctx.rank + 1) * 32]
        engine.step(data.x_train[mine], data.y_train[mine])
        sent.append(engine.stats.bytes_sent)
    engine.module.eval()
    with torch.no_grad():
        accuracy = (engine.module(data.x_val).argmax(1) == data.y_val).float().mean().item()
    return {"accuracy": accuracy, "bytes_sent": sent[-1]}


def _all(ctx: px.Context) -> dict:
    return {
        "strategies": _strategies_fp16(ctx),
        "none": _digits_accuracy(ctx, "none"),
        "fp16": _digits_accuracy(ctx, "fp16"),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_compressed_training(world_size: int) -> None:
    results = run_ranks(_all, world_size, timeout=240)
    for rank, r in enumerate(results):
        for key, value in r["strategies"].items():
            assert value["diff"] < 1e-3, f"rank {rank} {key}: {value['diff']}"
        for key in r["strategies"]:
            for a, b in zip(
                r["strategies"][key]["params"], results[0]["strategies"][key]["params"]
            ):  # noqa: E501
                assert torch.equal(a, b), f"rank {rank} {key}: replicas differ"
    none, fp16 = results[0]["none"], results[0]["fp16"]
    assert none["accuracy"] > 0.9
    assert abs(fp16["accuracy"] - none["accuracy"]) <= 0.01, (none, fp16)
    # Bytes on the wire halve (plus 4 bytes of scale per message).
    assert fp16["bytes_sent"] < 0.51 * none["bytes_sent"], (none, fp16)
