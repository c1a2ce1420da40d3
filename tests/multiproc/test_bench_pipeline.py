"""``phalanx bench pipeline`` on a tiny GPT: both sides run, every figure the issue asks for is
there and sane (this checks the harness, not speed)."""

from __future__ import annotations

import pytest

from phalanx.bench.pipeline import PipelineBenchConfig, format_report, run_benchmark
from phalanx.errors import ConfigError


def test_bench_pipeline_reports_every_figure() -> None:
    cfg = PipelineBenchConfig(
        schedules=("1f1b",), microbatches=(2,), batch_size=4, seq_len=8, dim=16,
        num_blocks=1, warmup=1, rounds=1, steps=1,
    )  # fmt: skip
    result = run_benchmark(cfg)
    (row,) = result["rows"]
    assert row["phalanx_step_s"] > 0 and row["torch_step_s"] > 0 and row["throughput_ratio"] > 0
    assert row["bubble_theory"] == pytest.approx(1 / 3)
    assert sum(row["param_share_per_rank"]) == pytest.approx(1.0)
    assert row["transfer_bytes_per_step"] == 2 * 2 * (2 * 8 * 16 * 4)  # 2 x M x activation
    assert "1f1b" in format_report(result)


def test_bench_pipeline_bad_flags_are_one_line() -> None:
    with pytest.raises(ConfigError, match="--microbatches: 3 does not split --batch-size 32"):
        PipelineBenchConfig(microbatches=(3,)).validate()
    with pytest.raises(ConfigError, match="--schedules: unknown schedule 'zb'"):
        PipelineBenchConfig(schedules=("zb",)).validate()
