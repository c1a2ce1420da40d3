"""Mixed precision: bf16 autocast on N ranks equals one process under the same autocast; fp16's
loss scale skips an overflowing step on every rank alike and halves the scale everywhere; the
digits CNN trained in bf16 from its config reaches its accuracy target."""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import phalanx as px
from tests.helpers.equivalence import (
    assert_states_close,
    global_batches,
    one_process,
    train_shards,
)
from tests.helpers.spawn import run_ranks

ROOT = Path(__file__).resolve().parents[2]
STEPS, LOCAL_BATCH, OVERFLOW_STEP = 5, 4, 2
ADAM = functools.partial(torch.optim.SGD, lr=0.1)  # SGD: Adam amplifies rounding where g ~ 0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return global_batches(world, steps=STEPS, features=8, classes=4, local_batch=LOCAL_BATCH)


def _reference(batches: list, dtype: torch.dtype, skip: int | None = None) -> dict:
    """One process, the global batch, autocast to ``dtype``; fp16 steps unscale exactly."""
    scale = 2.0**16 if dtype == torch.float16 else 1.0
    skipped = () if skip is None else (skip,)
    return one_process(_model(), ADAM, batches, skip=skipped, autocast=dtype,
                       loss_scale=scale).state()  # fmt: skip


class OverflowOnRank:
    """Cross entropy; on ``rank`` at call ``at`` the loss is multiplied so fp16 backward
    overflows (the loss itself stays finite in fp32)."""

    def __init__(self, rank: int, at: int) -> None:
        self.rank, self.at, self.calls = rank, at, 0

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(out, y)
        hit = self.calls == self.at and px.init().rank == self.rank
        self.calls += 1
        return loss * 1e30 if hit else loss


def _run(ctx: px.Context) -> dict:
    out, batches = {}, _batches(ctx.world_size)
    for strategy in ("allreduce", "partitioned"):
        for precision in ("bf16", "fp16"):
            loss_fn = (OverflowOnRank(ctx.world_size - 1, OVERFLOW_STEP)
                       if precision == "fp16" else nn.functional.cross_entropy)  # fmt: skip
            model = copy.deepcopy(_model())
            dtypes = []  # what the first layer computed in: autocast must be on
            model[0].register_forward_hook(lambda m, i, o, d=dtypes: d.append(o.dtype))
            engine = px.Engine(model, loss_fn, ADAM, exchange=strategy, precision=precision,
                               context=ctx)  # fmt: skip
            skipped = train_shards(engine, batches, local_batch=LOCAL_BATCH, sync=False,
                                   observe=lambda e: e.stats.nonfinite_skipped)  # fmt: skip
            out[(strategy, precision)] = {
                "state": engine.module.state_dict(),
                "skipped": skipped,
                "scale": engine.precision.scale,
                "dtypes": set(dtypes),
            }
            engine.close()
    # Compression composes with precision: bf16 forward, fp16 gradient messages.
    engine = px.Engine(copy.deepcopy(_model()), nn.functional.cross_entropy, ADAM,
                       precision="bf16", compress="fp16", context=ctx)  # fmt: skip
    train_shards(engine, batches, local_batch=LOCAL_BATCH, sync=False)
    out["bf16+fp16 messages"] = engine.module.state_dict()
    engine.close()
    for kwargs in ({"exchange": "ps"}, {"nonfinite": "abort"}):
        try:
            px.Engine(_model(), nn.functional.cross_entropy, ADAM, precision="fp16",
                      context=ctx, **kwargs)  # fmt: skip
            out[str(kwargs)] = "accepted"
        except px.ConfigError as e:
            out[str(kwargs)] = str(e)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_bf16_and_fp16_equal_one_process(world_size: int) -> None:
    results = run_ranks(_run, world_size, timeout=240)
    batches = _batches(world_size)
    expected = {
        "bf16": _reference(batches, torch.bfloat16),
        "fp16": _reference(batches, torch.float16, skip=OVERFLOW_STEP),
    }
    for rank, result in enumerate(results):
        for strategy in ("allreduce", "partitioned"):
            fp16 = result[(strategy, "fp16")]
            assert fp16["skipped"] == [s == OVERFLOW_STEP for s in range(STEPS)], rank
            assert fp16["scale"] == 2.0**15  # halved once, on every rank
            assert result[(strategy, "bf16")]["dtypes"] == {torch.bfloat16}
            assert fp16["dtypes"] == {torch.float16}
            for precision, tolerance in (("bf16", 5e-4), ("fp16", 1e-4)):
                state = result[(strategy, precision)]["state"]
                what = f"rank {rank} {strategy} {precision}"
                assert_states_close(state, expected[precision], atol=tolerance, rtol=0, what=what)
        state, what = result["bf16+fp16 messages"], f"rank {rank} bf16+fp16 messages"
        assert_states_close(state, expected["bf16"], atol=2e-3, rtol=0, what=what)
        assert result[str({"exchange": "ps"})].startswith("precision: fp16 needs its loss scale")
        assert result[str({"nonfinite": "abort"})].startswith("nonfinite: 'abort' with precision")


@pytest.mark.timeout(180)
def test_digits_cnn_in_bf16_reaches_its_target(tmp_path: Path) -> None:
    run_dir = tmp_path / "bf16"
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "train", str(ROOT / "configs" / "digits_cnn.toml"),
         "--nproc", "2", "--set", "train.precision=bf16", "--set", "train.progress=false",
         "--run-dir", str(run_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=170, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads((run_dir / "summary.json").read_text())["val_accuracy"] >= 0.95
