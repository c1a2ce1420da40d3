"""Checkpoints through torch.distributed.checkpoint: at world 2 a sharded strategy's ranks
hand DCP only their own share of the optimizer state and each writes its own shard file (what
every rank holds, rank 0 writes), a background save writes the state of the moment it was
asked for; at world 3 each of those checkpoints resumes (under the same strategy or another)
and continues as one process training on the same global batches would."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import phalanx as px
from phalanx import checkpoint
from tests.helpers.equivalence import (
    ADAM,
    LOCAL_BATCH,
    ReversedNet,
    copy_params,
    global_batches,
    make_engine,
    one_process,
    train_shards,
)
from tests.helpers.spawn import run_ranks

SAVED = {  # checkpoint name -> the strategy that writes it at world 2
    "allreduce": ("allreduce", {}),
    "native": ("partitioned", {"schedule": "native"}),
    "cyclic": ("partitioned", {"schedule": "cyclic"}),
    "ps": ("ps", {"servers": 0, "reduce": "star"}),
}
WRITERS = {  # checkpoint name -> the ranks with a shard file: rank 1 only for what it owns
    "allreduce": [0],
    "native": [0, 1],
    "cyclic": [0],  # (cyclic at world 2: rank 0 owns everything)
    "ps": [0, 1],
}
RESUMED = {  # checkpoint name -> the strategy that resumes it at world 3
    "allreduce": ("allreduce", {}),
    "native": ("partitioned", {"schedule": "cyclic"}),
    "cyclic": ("allreduce", {}),
    "ps": ("ps", {"servers": 1, "reduce": "tree"}),
}
FIRST, SECOND = 3, 3  # steps before the checkpoint (world 2), after it (world 3)


def _optimizer_bytes(state: dict) -> int:
    """Bytes of the optimizer tensors this rank hands DCP (its pieces of shared tensors)."""
    total = 0
    for entry in state["optimizer"]["state"].values():
        for value in entry.values():
            if isinstance(value, checkpoint.Slices):
                total += value.nbytes()
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                total += value.numel() * value.element_size()
    return total


def _engine(ctx: px.Context, model: nn.Module, strategy: str, options: dict) -> px.Engine:
    """Adam, several buckets (so several partitions per step)."""
    return make_engine(ctx, model, ADAM, strategy, options, bucket_mb=0.004)


def _save_at_two(ctx: px.Context, root: Path) -> dict:
    torch.manual_seed(0)
    model, batches = ReversedNet(), global_batches(2)[:FIRST]
    out: dict = {"handed": {}, "held": {}, "slices": {}}
    for name, (strategy, options) in SAVED.items():
        engine = _engine(ctx, model, strategy, options)
        train_shards(engine, batches)
        state = engine.state_dict()
        out["handed"][name] = _optimizer_bytes(state)
        out["held"][name] = engine.optimizer_bytes()
        out["slices"][name] = any(
            isinstance(v, checkpoint.Slices)
            for entry in state["optimizer"]["state"].values()
            for v in entry.values()
        )
        checkpoint.save(root / name, FIRST, {"engine": engine}, group=ctx.group)
        if name == "allreduce":  # a background save keeps the state of the moment it was asked
            group = dist.new_group(backend="gloo")
            pending = checkpoint.save_async(root / "async", FIRST, {"engine": engine}, group=group)
            out["at_save"] = copy_params(engine.module)
            # changes the parameters meanwhile
            train_shards(engine, global_batches(2, seed=3)[:1])
            pending.wait()
        engine.close()
    return out


def _resume_at_three(ctx: px.Context, root: Path) -> dict:
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    out = {}
    for name, (strategy, options) in RESUMED.items():
        engine = _engine(ctx, ReversedNet(), strategy, options)
        found = checkpoint.restore(root / name, {"engine": engine}, group=ctx.group)
        assert found.step == FIRST and engine.num_steps == FIRST, (found, engine.num_steps)
        workers = engine.data_world_size  # ps with a dedicated server: 2 workers
        second = [(x[: LOCAL_BATCH * workers], y[: LOCAL_BATCH * workers])
                  for x, y in global_batches(workers, seed=7)[:SECOND]]  # fmt: skip
        train_shards(engine, second)
        out[name] = copy_params(engine.module) if engine.is_trainer else None
        engine.close()
    return out


def _uninterrupted(workers_after: int) -> list[torch.Tensor]:
    """One process: FIRST steps on world-2 global batches, then SECOND on the resumed ones."""
    torch.manual_seed(0)
    second = [(x[: LOCAL_BATCH * workers_after], y[: LOCAL_BATCH * workers_after])
              for x, y in global_batches(workers_after, seed=7)[:SECOND]]  # fmt: skip
    model = one_process(ReversedNet(), ADAM, global_batches(2)[:FIRST] + second).model
    return [p.detach() for p in model.parameters()]


def test_world_two_checkpoints_resume_on_world_three(tmp_path: Path) -> None:
    saved = run_ranks(_save_at_two, 2, tmp_path, timeout=240)
    for name in SAVED:
        directory = tmp_path / name / f"step-{FIRST:07d}"
        record = json.loads((tmp_path / name / f"step-{FIRST:07d}.json").read_text())
        shards = {f"__{rank}_0.distcp" for rank in WRITERS[name]}
        assert set(record["files"]) == {*shards, ".metadata"}, name
        assert all((directory / f).stat().st_size == e["bytes"] for f, e in record["files"].items())
    # Sharded strategies: each rank hands DCP only the state it holds (about half), never the
    # other rank's; plain data parallel holds (and hands) all of it on every rank.
    full = saved[0]["held"]["allreduce"]
    for name in ("native", "cyclic", "ps"):  # (cyclic at world 2: rank 0 owns everything)
        for rank, r in enumerate(saved):
            assert r["handed"][name] <= r["held"][name] + 64, (name, rank, r)
            if name != "cyclic":
                assert r["held"][name] <= full / 2 * 1.05 + 64, (name, rank, r)
        assert name == "cyclic" or any(r["slices"][name] for r in saved), name  # split params
        assert sum(r["handed"][name] for r in saved) >= full - 64, name
    assert all(abs(r["handed"]["allreduce"] - full) <= 64 for r in saved)
    # The background save holds the parameters of the moment it was asked for.
    written = checkpoint.load(tmp_path / "async")["engine"]["model"]
    names = [n for n, _ in ReversedNet().named_parameters()]
    for name, value in zip(names, saved[0]["at_save"]):
        assert torch.equal(written[name], value), name

    resumed = run_ranks(_resume_at_three, 3, tmp_path, timeout=240)
    for name, (_, options) in RESUMED.items():
        workers = 3 - options.get("servers", 0)
        reference = _uninterrupted(workers)
        for rank, r in enumerate(resumed):
            if r[name] is None:
                continue  # a dedicated server holds no replica
            for a, b in zip(r[name], reference):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6, msg=f"{name} rank {rank}")
