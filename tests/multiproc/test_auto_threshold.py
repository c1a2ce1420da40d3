"""bucket_mb = "auto": every rank measures the same link, agrees on one threshold after the
profiled steps, rebuilds its buckets, and training still equals one process exactly."""

from __future__ import annotations

import torch

import phalanx as px
from tests.helpers.equivalence import (
    ADAM,
    ReversedNet,
    global_batches,
    make_engine,
    max_diff,
    one_process,
    train_shards,
)
from tests.helpers.spawn import run_ranks


def _auto(ctx: px.Context) -> dict:
    torch.manual_seed(0)
    model, batches = ReversedNet(), global_batches(ctx.world_size)
    out = {}
    for name, options in (("allreduce", {}), ("partitioned", {"schedule": "native"})):
        engine = make_engine(ctx, model, ADAM, name, options, bucket_mb="auto")
        # The model chooses after step 4, then the distinct candidate layouts take turns: 3
        # visits of 4 steps each (the first untimed), at most 36 steps.
        train_shards(engine, (batches * 7)[:42])
        reference = one_process(model, ADAM, (batches * 7)[:42]).model
        out[name] = {
            "threshold": engine.auto.threshold.bucket_bytes if engine.auto.threshold else None,
            "done": engine.auto.done,
            "trials": engine.auto.trials_text,
            "bucket_bytes": engine.buckets.bucket_bytes,
            "alpha_beta": (engine.auto.link.alpha_s, engine.auto.link.beta_bytes_per_s),
            "describe": engine.auto.threshold.describe() if engine.auto.threshold else "",
            "diff": max_diff(engine.module, reference),
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
