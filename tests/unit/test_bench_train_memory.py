"""``phalanx bench memory``: whole ``phalanx train`` processes (none, full recomputation, a
budget) on a small activation-dominated model; the report's rows and target lines; one-line
flag errors. No timing assertions."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.bench import train_memory as bench
from tests.helpers.cli import assert_one_line_error, run_main

BLOCK = (
    '  { type = "linear", in_features = 64, out_features = 2048 },\n  { type = "gelu" },\n'
    '  { type = "linear", in_features = 2048, out_features = 64 },\n'
)
CONFIG = (
    '[model]\nlayers = [\n  { type = "embedding", num_embeddings = 97, embedding_dim = 64 },\n'
    + BLOCK * 4
    + '  { type = "linear", in_features = 64, out_features = 97 },\n]\n'
    '[data]\nsource = "text"\nseq_len = 256\nbatch_size = 16\nval_fraction = 0.01\n'
)


@pytest.mark.slow  # spawns processes or trains for real: not in make test-fast
@pytest.mark.timeout(300)
def test_processes_are_measured_and_reported(tmp_path: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(CONFIG)
    cfg = bench.TrainMemoryBenchConfig(
        configs=(str(config),), budgets=(0.9,), rounds=1, steps=3, warmup=1
    )
    cfg.validate()
    result = bench.run_benchmark(cfg)
    bench.check(result)
    model = result["models"]["tiny"]
    summary = model["summary"]
    assert list(summary) == ["none", "recompute", "phalanx@0.9"]
    for name, row in summary.items():
        assert "error" not in row, (name, row)
        assert row["peak_mb"] > 0 and row["median_step_s"] > 0
    budgeted = summary["phalanx@0.9"]
    assert budgeted["budget_mb"] == pytest.approx(0.9 * model["unmanaged_peak_mb"], abs=0.1)
    assert budgeted["predicted_peak_mb"] is not None
    report = bench.format_report(result)
    assert "save_on_cpu    not run" in report
    assert "n/a   step time at the 50% budget" in report
    assert "phalanx@0.9: measured peak" in report


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rounds", "0"], "--rounds and --steps must be >= 1"),
        (["--steps", "2", "--warmup", "2"], "--warmup: 2 leaves no timed step of 2"),
        (["--budgets", "0.5,1.5"], "--budgets: fractions in (0, 1)"),
        (["--configs", "/nonexistent.toml"], "--configs: '/nonexistent.toml' is not a file"),
    ],
)
def test_bad_flags_are_one_line(flags: list[str], message: str, capsys) -> None:
    assert run_main(["bench", "memory", *flags]) == 2
    assert_one_line_error(capsys.readouterr().err, message)
