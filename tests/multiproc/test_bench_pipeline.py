"""``phalanx bench pipeline`` on a tiny GPT: both sides run, every figure the issue asks for is
there and sane (this checks the harness, not speed)."""

from __future__ import annotations

import pytest

from phalanx.bench.pipeline import PipelineBenchConfig, format_report, run_benchmark
from phalanx.errors import ConfigError
from phalanx.parallel.pipeline_schedules import schedule_kind


def test_bench_pipeline_reports_every_figure() -> None:
    cfg = PipelineBenchConfig(
        schedules=("1f1b", "zbv", "dualpipev"), microbatches=(2,), batch_size=4, seq_len=8,
        dim=16, num_blocks=1, warmup=1, rounds=1, steps=1,
    )  # fmt: skip
    result = run_benchmark(cfg)
    row, zbv, dualpipev = result["rows"]
    activation = 2 * 8 * 16 * 4  # one micro-batch of 2 sequences
    if not schedule_kind("zbv").available:  # torch < 2.13 (the GPU machine's 2.11): refused
        assert "'zbv' needs torch >= 2.13 here" in zbv["refused"], zbv
        assert row["phalanx_step_s"] > 0 and row["torch_step_s"] > 0
        assert "refused: schedule: 'zbv' needs torch" in format_report(result)
        return
    for r in (row, zbv):
        assert r["phalanx_step_s"] > 0 and r["torch_step_s"] > 0 and r["throughput_ratio"] > 0
        assert r["bubble_1f1b"] == pytest.approx(1 / 3)
        assert sum(r["param_share_per_rank"]) == pytest.approx(1.0)
    assert row["bubble_theory"] == pytest.approx(1 / 3)
    assert row["transfer_bytes_per_step"] == 2 * 2 * activation  # 2 x M x activation
    assert zbv["bubble_theory"] == 0.0  # the claim
    # Zero bubble splits backward into input and weight passes (stage 0's W is a full one).
    assert sorted(row["pass_ms"]) == ["forward", "full"]
    assert sorted(zbv["pass_ms"]) == ["forward", "full", "input", "weight"]
    # 4 stages in a V: 0 -> 1 and 2 -> 3 cross between the ranks; 1 -> 2 stays on rank 1.
    assert zbv["transfer_bytes_per_step"] == 2 * 2 * 2 * activation
    assert dualpipev == {
        "schedule": "dualpipev",
        "microbatches": 2,
        "refused": "microbatches: dualpipev needs at least 2 x pipeline = 4 micro-batches, got 2",
    }
    report = format_report(result)
    assert "1f1b" in report and "zbv" in report
    assert "refused: microbatches: dualpipev needs at least 2 x pipeline" in report


def test_bench_pipeline_bad_flags_are_one_line() -> None:
    with pytest.raises(ConfigError, match="--microbatches: 3 does not split --batch-size 32"):
        PipelineBenchConfig(microbatches=(3,)).validate()
    with pytest.raises(ConfigError, match="--schedules: unknown schedule 'zb'"):
        PipelineBenchConfig(schedules=("zb",)).validate()
