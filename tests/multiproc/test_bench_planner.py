"""``phalanx bench planner`` end to end on one small cell (the numbers: docs/benchmarks.md),
and its flag errors."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import pytest

from phalanx.bench.planner import PlannerBenchConfig, format_report, run_benchmark
from phalanx.errors import ConfigError


def test_one_cell_is_measured_traced_and_predicted() -> None:
    cfg = PlannerBenchConfig(
        models=("digits_cnn",), strategies=("tree", "ps"), compress=("fp16",),
        thresholds=("25",), warmup=2, steps=3, blocks=2,
    )  # fmt: skip
    traces = sorted(Path(tempfile.gettempdir()).glob("phalanx-plan-bench-*"))
    result = run_benchmark(cfg)
    assert sorted(Path(tempfile.gettempdir()).glob("phalanx-plan-bench-*")) == traces  # removed
    row, ps = result["rows"]
    assert len(row["blocks"]) == 2 and len(ps["blocks"]) == 2  # every cell, block by block
    for block in row["blocks"]:  # one simulated step per timed step, from its straggler
        assert len(block["profiles"]) == 3 and set(block["stragglers"]) <= {0, 1}
        assert block["error"] == block["predicted_s"] / block["measured_s"] - 1
    # the row shows its median block (the lower of two)
    assert row["error"] == min(b["error"] for b in row["blocks"])
    assert row["measured_s"] > 0 and row["predicted_s"] > 0
    assert ps["cluster"]["message_overhead_s"] >= 0  # the message probe ran
    # calibrated before each round of blocks; every block predicted from their median
    assert len(row["calibrations"]) == 2 and row["calibrations"] == ps["calibrations"]
    assert all(c["handoff_median_s"] > 0 and c["message_mean_s"] > 0 for c in row["calibrations"])
    assert all(b["cluster"] == row["cluster"] for b in row["blocks"] + ps["blocks"])
    beta = statistics.median(c["beta_bytes_per_s"] for c in row["calibrations"])
    assert row["cluster"]["intra"]["beta_bytes_per_s"] == pytest.approx(2 * beta)  # Gloo: p beta
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
    with pytest.raises(ConfigError, match="--blocks: at least 1"):
        PlannerBenchConfig(blocks=0).validate()
