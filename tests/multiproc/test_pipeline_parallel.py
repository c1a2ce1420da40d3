"""Pipeline parallelism equals one-process training (F6, F7).

Each spawned world runs several layouts one after another (spawning costs seconds here): for
each, parameters after a few steps must match one process training on the same global batch,
and the transfer layers must have moved exactly the activations' bytes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.parallel import ParallelConfig
from tests.helpers.spawn import run_ranks

STEPS = 3
BATCH = 8  # per replica
FEATURES, HIDDEN, CLASSES = 6, 12, 4


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.LayerNorm(HIDDEN),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, CLASSES),
    )


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def batches(num_replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    n = BATCH * num_replicas
    return [
        (torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g))
        for _ in range(STEPS)
    ]


def reference(
    num_replicas: int, optimizer: str, max_grad_norm: float | None = None, skip_step: int = 0
) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = make_optimizer(optimizer)(list(model.parameters()))
    for step, (x, y) in enumerate(batches(num_replicas), start=1):
        if step == skip_step:
            continue
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def make_optimizer(name: str) -> Any:
    if name == "adam":
        return lambda ps: torch.optim.Adam(ps, lr=0.01)
    return lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)


# The first layout of each world meets an injected NaN loss at step 2 on rank 1 (a last stage,
# of replica 0): every rank, of every stage and replica, must skip that step, and the clipping
# norm must be the whole model's.
FAULT = "nan@forward:step=2:rank=1"
GUARD_LAYOUT = ("1f1b nan+clip", {"schedule": "1f1b", "microbatches": 2}, {"max_grad_norm": 0.05})
# (name, ParallelConfig kwargs, Engine kwargs, stages, optimizer)
LAYOUTS_2 = [
    (*GUARD_LAYOUT, [0, 0, 0, 1, 1, 1, 1], "sgd"),
    ("gpipe", {"schedule": "gpipe", "microbatches": 4}, {}, [0, 0, 0, 1, 1, 1, 1], "sgd"),
    ("1f1b uneven", {"schedule": "1f1b", "microbatches": 2}, {}, [0, 1, 1, 1, 1, 1, 1], "adam"),
    (
        "interleaved",
        {"schedule": "interleaved", "microbatches": 4, "virtual_stages": 2},
        {},
        [0, 0, 1, 1, 2, 2, 3],
        "sgd",
    ),
    (
        "1f1b accumulate",
        {"schedule": "1f1b", "microbatches": 2},
        {"accumulate_steps": 2},
        [0, 0, 0, 0, 1, 1, 1],
        "sgd",
    ),
    ("looped_bfs even", {"schedule": "looped_bfs", "split": "even"}, {}, None, "sgd"),
    # Zero bubble: torch's weight-gradient pass writes .grad past the buckets' hooks; V-shaped
    # placements keep stages 1 and 2 on rank 1 (no transfer between them).
    ("zbv", {"schedule": "zbv", "microbatches": 4}, {}, [0, 0, 1, 1, 2, 2, 3], "adam"),
    ("dualpipev", {"schedule": "dualpipev", "microbatches": 4}, {}, [0, 1, 1, 2, 2, 3, 3], "sgd"),
    (
        "interleaved_zb",
        {"schedule": "interleaved_zb", "microbatches": 4},
        {},
        [0, 0, 1, 1, 2, 2, 3],
        "sgd",
    ),
]
LAYOUTS_3 = [("gpipe", {"schedule": "gpipe", "microbatches": 4}, {}, [0, 0, 1, 1, 2, 2, 2], "sgd")]
LAYOUTS_4 = [
    (*GUARD_LAYOUT, [0, 0, 0, 0, 1, 1, 1], "adam"),
    (
        "1f1b partitioned",
        {"schedule": "1f1b", "microbatches": 4},
        {"exchange": "partitioned"},
        [0, 0, 0, 1, 1, 1, 1],
        "sgd",
    ),
    (
        "gpipe tree",
        {"schedule": "gpipe", "microbatches": 2},
        {"exchange": "tree"},
        [0, 0, 0, 0, 1, 1, 1],
        "adam",
    ),
    (  # 2 x 2: fully_shard on the data axis, stages on the pipeline axis
        "1f1b fsdp",
        {"schedule": "1f1b", "microbatches": 4},
        {"exchange": "fsdp"},
        [0, 0, 0, 1, 1, 1, 1],
        "adam",
    ),
    ("zbv 2 replicas", {"schedule": "zbv", "microbatches": 4}, {}, [0, 1, 1, 2, 2, 3, 3], "adam"),
]


def _runnable(layouts: list) -> list:
    """The layouts whose schedule this torch runs (newer schedules need newer releases)."""
    from phalanx.parallel.pipeline_schedules import schedule_kind

    return [lay for lay in layouts if schedule_kind(lay[1].get("schedule", "1f1b")).available]


def train_layouts(ctx: Any, pipeline: int, layouts: list) -> list[dict]:
    results = []
    for name, parallel_kw, engine_kw, stages, optimizer in layouts:
        parallel = ParallelConfig(pipeline=pipeline, **parallel_kw)
        num_replicas = ctx.world_size // pipeline
        micro = BATCH // engine_kw.get("accumulate_steps", 1) // parallel.num_microbatches
        engine = px.Engine(
            make_model(),
            loss_fn,
            make_optimizer(optimizer),
            parallel=parallel,
            stages=stages,
            sample_input=torch.zeros(micro, FEATURES),
            context=ctx,
            **engine_kw,
        )
        replica = engine.data_rank
        losses = []
        for x, y in batches(num_replicas):
            part = slice(replica * BATCH, (replica + 1) * BATCH)
            losses.append(float(engine.step(x[part], y[part])))
        state = {k: v.clone() for k, v in engine.full_state_dict().items()}
        evaluated = engine.pipeline.forward(batches(1)[0][0])  # stage by stage, as validation
        expected_bytes = sum(
            2 * t.nbytes * parallel.num_microbatches * engine.accumulate_steps
            for t in engine.pipeline.transfers
        )
        results.append(
            {
                "name": name,
                "state": state,
                "transfer_bytes": engine.stats.transfer_bytes,
                "expected_bytes": expected_bytes,
                "reports_loss": engine.reports_loss,
                "losses": losses,
                "printed": str(engine.pipeline.stages),
                "skipped": engine.guard.num_nonfinite_steps,
                "evaluated": evaluated,
            }
        )
        engine.close()
    return results


def check_world(world_size: int, pipeline: int, layouts: list) -> None:
    layouts = _runnable(layouts)
    guarded = layouts[0][0] == GUARD_LAYOUT[0]
    env = {"PHALANX_FAULT": FAULT} if guarded else None
    per_rank = run_ranks(train_layouts, world_size, pipeline, layouts, timeout=300, env=env)
    num_replicas = world_size // pipeline
    for i, (name, _, engine_kw, _, optimizer) in enumerate(layouts):
        skip_step = 2 if guarded and i == 0 else 0
        expected = reference(
            num_replicas, optimizer, engine_kw.get("max_grad_norm"), skip_step=skip_step
        )
        seen: dict[str, torch.Tensor] = {}
        for rank, results in enumerate(per_rank):
            result = results[i]
            assert result["transfer_bytes"] == result["expected_bytes"], (name, rank)
            for key, value in result["state"].items():
                torch.testing.assert_close(
                    value, expected[key], rtol=1e-4, atol=2e-5, msg=f"{name}: rank {rank} {key}"
                )
                seen[key] = value
        assert sorted(seen) == sorted(expected), f"{name}: the stages hold the whole model"
        reporting = [rank for rank in range(world_size) if per_rank[rank][i]["reports_loss"]]
        assert len(reporting) == num_replicas, name  # one last stage per replica
        model = make_model()
        model.load_state_dict(expected)
        with torch.no_grad():
            wanted = model.eval()(batches(1)[0][0])
        for rank in range(world_size):
            evaluated = per_rank[rank][i]["evaluated"]
            assert (evaluated is not None) == (rank in reporting), (name, rank)
            if evaluated is not None:
                torch.testing.assert_close(evaluated, wanted, rtol=1e-4, atol=2e-5, msg=name)
        for rank in reporting:  # the fault made rank 1's loss NaN; the others' stay finite
            finite = torch.isfinite(torch.tensor(per_rank[rank][i]["losses"])).tolist()
            bad_step = skip_step if rank == 1 else 0
            assert finite == [step != bad_step for step in range(1, STEPS + 1)], (name, finite)
        skipped = [results[i]["skipped"] for results in per_rank]
        assert skipped == [int(skip_step > 0)] * world_size, (name, skipped)
    printed = per_rank[0][0]["printed"]
    assert "TransferLayer(stage 0 -> 1" in printed and "bytes per micro-batch" in printed


def test_pipeline_two_ranks_every_schedule() -> None:
    check_world(2, 2, LAYOUTS_2)


@pytest.mark.slow
def test_pipeline_three_ranks() -> None:
    check_world(3, 3, LAYOUTS_3)


@pytest.mark.slow
def test_two_replicas_of_two_stages_with_other_strategies() -> None:
    check_world(4, 2, LAYOUTS_4)


def _trainer_config(steps: int, pipeline: int, run_dir: str) -> Any:
    from phalanx.config import config_from_data

    layers = [
        {"type": "flatten", "stage": 0},
        {"type": "linear", "in_features": 64, "out_features": 32, "stage": 0},
        {"type": "tanh", "stage": 1},
        {"type": "linear", "in_features": 32, "out_features": 10, "stage": 1},
    ]
    return config_from_data(
        {
            "model": {"layers": layers},
            "data": {"source": "digits", "batch_size": 16},
            "train": {"steps": steps, "progress": False, "run_dir": run_dir},
            "optimizer": {"name": "adam", "lr": 0.01},
            "checkpoint": {"every": 2},
            "parallel": {"pipeline": pipeline, "microbatches": 2},
        }
    )


def _train(ctx: Any, steps: int, pipeline: int, run_dir: str, resume: bool) -> dict:
    from phalanx.trainer import Trainer

    trainer = Trainer(_trainer_config(steps, pipeline, run_dir), run_dir, resume=resume)
    summary = trainer.run()
    state = {k: v.clone() for k, v in trainer.engine.module.state_dict().items()}
    return {"state": state, "val_loss": summary["val_loss"]}


def _train_twice(ctx: Any, root: str) -> list[dict]:
    whole = _train(ctx, 4, 2, f"{root}/whole", resume=False)
    _train(ctx, 2, 2, f"{root}/parts", resume=False)
    resumed = _train(ctx, 4, 2, f"{root}/parts", resume=True)
    return [whole, resumed]


def test_each_stage_checkpoints_its_part_and_resumes_exactly(tmp_path: Any) -> None:
    import shutil

    (whole0, resumed0), (whole1, resumed1) = run_ranks(_train_twice, 2, str(tmp_path))
    for whole, resumed in ((whole0, resumed0), (whole1, resumed1)):
        assert whole["state"].keys() == resumed["state"].keys()
        for key, value in whole["state"].items():
            torch.testing.assert_close(resumed["state"][key], value, rtol=0, atol=0)
    assert sorted(whole0["state"]) == ["1.bias", "1.weight"]  # stage 0's layers only
    assert sorted(whole1["state"]) == ["3.bias", "3.weight"]
    # The stages' parts make one checkpoint: one process resumes it with the model whole.
    shutil.copytree(tmp_path / "parts", tmp_path / "alone")
    latest = tmp_path / "alone" / "checkpoints" / "latest.json"
    latest.write_text((tmp_path / "alone" / "checkpoints" / "step-0000002.json").read_text())
    for newer in (tmp_path / "alone" / "checkpoints").glob("step-0000004*"):
        shutil.rmtree(newer) if newer.is_dir() else newer.unlink()
    (alone,) = run_ranks(_train, 1, 4, 1, str(tmp_path / "alone"), True)
    merged = {**whole0["state"], **whole1["state"]}
    assert alone["state"].keys() == merged.keys()
    for key, value in merged.items():
        torch.testing.assert_close(alone["state"][key], value, rtol=1e-6, atol=1e-7)
    assert alone["val_loss"] == pytest.approx(whole1["val_loss"], rel=1e-5)
