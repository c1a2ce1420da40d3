"""``phalanx bench planner`` end to end on one small cell (the numbers: docs/benchmarks.md),
and its flag errors."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from phalanx.bench.planner import PlannerBenchConfig, format_report, run_benchmark
from phalanx.errors import ConfigError


def test_one_cell_is_measured_traced_and_predicted() -> None:
    cfg = PlannerBenchConfig(
        models=("digits_cnn",), strategies=("tree",), compress=("fp16",), thresholds=("25",),
        warmup=2, steps=3,
    )  # fmt: skip
    traces = sorted(Path(tempfile.gettempdir()).glob("phalanx-plan-bench-*"))
    result = run_benchmark(cfg)
    assert sorted(Path(tempfile.gettempdir()).glob("phalanx-plan-bench-*")) == traces  # removed
    (row,) = result["rows"]
    # one simulated step per timed step, each from that step's straggler
    assert len(row["profiles"]) == 3 and set(row["stragglers"]) <= {0, 1}
    assert row["measured_s"] > 0 and row["predicted_s"] > 0
    assert row["forward_s"] > 0 and row["backward_s"] > 0 and row["optimizer_s"] > 0
    assert row["simulated_buckets"] == row["num_buckets"]  # the simulator re-formed the buckets
    assert row["cluster"]["shared_intra"] and row["setup"]["compress"] == "fp16"
    assert "within 10%:" in format_report(result)


def test_bad_flags_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="--models: unknown model 'gpt'"):
        PlannerBenchConfig(models=("gpt",)).validate()
    with pytest.raises(ConfigError, match="--thresholds: 'big'"):
        PlannerBenchConfig(thresholds=("big",)).validate()
    with pytest.raises(ConfigError, match="--steps: at least 3"):
        PlannerBenchConfig(steps=1).validate()
