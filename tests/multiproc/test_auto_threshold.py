"""bucket_mb = "auto": every rank measures the same link, agrees on one threshold after the
profiled steps, rebuilds its buckets, and training still equals one process exactly."""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

import phalanx as px
from phalanx.exchange import strategy_factory
from tests.helpers.spawn import run_ranks
from tests.multiproc.test_engine import LOCAL_BATCH, ReversedNet, _batches, _reference

ADAM = functools.partial(torch.optim.Adam, lr=0.01)


def _auto(ctx: px.Context) -> dict:
    torch.manual_seed(0)
    model, batches = ReversedNet(), _batches(ctx.world_size)
    out = {}
    for name, options in (("allreduce", {}), ("partitioned", {"schedule": "native"})):
        engine = px.Engine(
            copy.deepcopy(model), nn.functional.cross_entropy, ADAM, bucket_mb="auto",
            exchange=strategy_factory(name, options), context=ctx,
        )  # fmt: skip
        r = ctx.rank
        # The model chooses after step 4, then the distinct candidate layouts take turns: 3
        # visits of 4 steps each (the first untimed), at most 36 steps.
        for x, y in (batches * 7)[:42]:
            engine.step(
                x[r * LOCAL_BATCH : (r + 1) * LOCAL_BATCH],
                y[r * LOCAL_BATCH : (r + 1) * LOCAL_BATCH],
            )  # noqa: E501
        engine.sync()
        reference = _reference(model, ADAM, (batches * 7)[:42])
        out[name] = {
            "threshold": engine.threshold.bucket_bytes if engine.threshold else None,
            "done": engine.auto_done,
            "trials": engine.threshold_trials,
            "bucket_bytes": engine.buckets.bucket_bytes,
            "alpha_beta": (engine.link.alpha_s, engine.link.beta_bytes_per_s),
            "describe": engine.threshold.describe() if engine.threshold else "",
            "diff": max(
                (a - b).abs().max().item()
                for a, b in zip(engine.module.parameters(), reference.parameters())
            ),
        }
        engine.close()
    return out


def test_auto_threshold_is_agreed_and_training_stays_exact() -> None:
    results = run_ranks(_auto, 2, timeout=180)
    for name in ("allreduce", "partitioned"):
        first = results[0][name]
        assert first["threshold"] is not None and first["threshold"] > 0
        assert first["done"] and "kept" in first["trials"]  # candidates measured, one kept
        assert "fusion threshold" in first["describe"]
        alpha, beta = first["alpha_beta"]
        assert alpha >= 0 and beta > 0
        for r in results:
            assert r[name]["threshold"] == first["threshold"]  # every rank chose the same
            assert r[name]["bucket_bytes"] == first["bucket_bytes"]
            assert r[name]["trials"] == first["trials"]
            assert r[name]["alpha_beta"] == first["alpha_beta"]
            assert r[name]["diff"] < 1e-5, (name, r[name]["diff"])
