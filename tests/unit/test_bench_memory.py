"""``phalanx bench memory-layers``: a tiny run end to end, a fresh process per measurement (every
variant measured, the same losses), the summary's ratios and PASS/MISS lines, one-line config
errors (``--device cuda`` without a GPU too); on a GPU, a tiny run in this process on the device.
No timing assertions."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from phalanx.bench import memory_layers as bench
from phalanx.bench import rotate
from tests.helpers.cli import assert_one_line_error, run_main

TINY = bench.MemoryBenchConfig(
    batch_size=64,  # activations dominate: the smallest plan sits well under 75% of the peak
    channels=16,  # activations well above the spill tier's 8 MiB staging buffer
    image_size=32,
    blocks=6,  # activations dominate the kernels' workspace, so half of the peak can be met
    budgets=(0.75, 0.05),  # 0.05: below the planner's floor, reported instead of run
    rounds=1,
    steps=1,
    warmup=0,
    fresh_processes=True,  # as the bench runs: in-process RSS figures are too noisy for budgets
)


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow  # spawns processes or trains for real: not in make test-fast
def test_tiny_run_measures_every_variant() -> None:
    result = bench.run_benchmark(TINY)
    (only,) = result["rounds"]
    assert only["order"] == [
        "none", "checkpoint", "save_on_cpu", "phalanx@0.75", "phalanx@0.05", "phalanx@min"
    ]  # fmt: skip
    for name in ("none", "checkpoint", "save_on_cpu", "phalanx@0.75", "phalanx@min"):
        run = only["variants"][name]
        assert "error" not in run and _positive(run["peak_bytes"]), (name, run)
        assert _positive(run["median_step_s"]) and len(run["step_s"]) == 1
        row = result["summary"][name]
        assert _positive(row["median_step_s"]) and _positive(row["median_peak_bytes"])
        assert _positive(row["time_vs_none"]) and _positive(row["time_vs_checkpoint"])
    assert result["meta"]["same_losses"]  # offload and recomputation change no number
    assert _positive(result["meta"]["unmanaged_predicted_bytes"])
    half = result["summary"]["phalanx@0.75"]
    assert half["budget_bytes"] == pytest.approx(0.75 * result["meta"]["unmanaged_predicted_bytes"])
    assert half["predicted_peak_bytes"] <= half["budget_bytes"]
    assert half["spill_bytes_written"] == half["spill_bytes_read"]
    assert "cannot be met" in result["summary"]["phalanx@0.05"]["error"]
    smallest = result["summary"]["phalanx@min"]  # the plan a too-small budget cannot get
    assert smallest["predicted_peak_bytes"] <= smallest["budget_bytes"] < half["budget_bytes"]
    report = bench.format_report(result)
    assert any(
        line.startswith("phalanx@0.05") and "not run: memory.budget_mb:" in line
        for line in report.splitlines()
    )
    lines = [t["line"] for t in result["targets"]]
    # (the 50% target is reported as not applicable: 0.5 is not among this run's budgets)
    assert lines[0].startswith("n/a   overhead at the 50% budget")
    assert lines[-1].startswith("MISS  budget 5%: not run")
    assert "phalanx's smallest plan:" in lines[-1]


def _run(name: str, step_s: float, peak: int, **extra: Any) -> dict[str, Any]:
    return {
        "variant": name, "median_step_s": step_s, "peak_bytes": peak, "losses": [1.0],
        "minor_faults": [0], **extra,
    }  # fmt: skip


def _phalanx(step_s: float, peak: int, budget: int) -> dict[str, Any]:
    plan = {"budget_bytes": budget, "predicted_peak_bytes": budget, "choices": {"0": "offload"}}
    spill = [{"bytes_written": 8, "bytes_read": 8, "backward_wait_s": 0, "forward_wait_s": 0}]
    return _run("phalanx", step_s, peak, plan=plan, spill=spill)


def test_targets_pass_and_miss_lines() -> None:
    cfg = bench.MemoryBenchConfig(budgets=(0.75, 0.5), rounds=1)
    mib = 2**20
    variants = {
        "none": _run("none", 1.0, 300 * mib),
        "checkpoint": _run("checkpoint", 1.3, 120 * mib),
        "save_on_cpu": _run("save_on_cpu", 1.0, 300 * mib),
        "phalanx@0.75": _phalanx(1.4, 200 * mib, 225 * mib),  # slower than recomputation
        "phalanx@0.5": _phalanx(1.2, 100 * mib, 150 * mib),
        "phalanx@min": _phalanx(1.5, 60 * mib, 60 * mib),
    }
    meta = {
        "model": "m", "params": 1, "config": {**bench.asdict(cfg)},
        "unmanaged_predicted_bytes": 300 * mib, "fixed_bytes": mib,
    }  # fmt: skip
    result = bench.summarize({"meta": meta, "rounds": [{"order": [], "variants": variants}]}, cfg)
    half = result["summary"]["phalanx@0.5"]
    assert half["time_vs_none"] == pytest.approx(1.2)
    assert half["peak_vs_checkpoint"] == pytest.approx(100 / 120)
    overhead, at_75, at_50 = result["targets"]
    assert overhead["pass"] and overhead["line"].startswith("PASS  step time at the 50% budget:")
    assert "+20.0% vs none" in overhead["line"] and "peak -66.7%" in overhead["line"]
    assert not at_75["pass"] and "at a HIGHER peak" in at_75["line"]
    assert at_50["pass"] and "(0.92x)" in at_50["line"] and "lower or equal peak" in at_50["line"]
    assert "1200.0" in bench.format_report(result)


def test_rotation_starts_round_zero_with_none() -> None:
    names = bench.MemoryBenchConfig().variants()
    assert rotate(names, 0)[0] == "none"
    assert rotate(names, 1) == [*names[1:], "none"]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--budgets", "0.5,x"], "--budgets: expected fractions"),
        (["--budgets", "1.5"], "--budgets: 1.5 is not a fraction in (0, 1)"),
        (["--budgets", "0.5,0.5"], "--budgets: a fraction is given twice"),
        (["--rounds", "0"], "--rounds: must be >= 1"),
        (["--batch-size", "0"], "--batch-size: must be >= 1"),
        (["--spill-dir", "/no/such/dir"], "--spill-dir: '/no/such/dir' is not a directory"),
        (["--device", "tpu"], "--device: 'tpu' is not one of cpu, cuda"),
    ],
)
def test_config_errors_are_one_line(
    args: list[str], fragment: str, capsys: pytest.CaptureFixture
) -> None:
    assert run_main(["bench", "memory-layers", *args]) == 2
    assert_one_line_error(capsys.readouterr().err, fragment)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_one_line(capsys: pytest.CaptureFixture) -> None:
    assert run_main(["bench", "memory-layers", "--device", "cuda"]) == 2
    assert_one_line_error(capsys.readouterr().err, "--device cuda:", "use --device cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiny_run_on_cuda_measures_device_memory() -> None:
    """On a GPU, in this process: every baseline and phalanx's smallest plan run on the device,
    their peaks are CUDA's allocated bytes (exact in-process), the losses agree with none's;
    recomputation and save_on_cpu (pinned: the saved tensors leave the GPU) lower the peak."""
    cfg = dataclasses.replace(TINY, device="cuda", fresh_processes=False)
    result = bench.run_benchmark(cfg)
    bench.check(result)
    assert result["meta"]["peak_of"].startswith("device:")
    (only,) = result["rounds"]
    for name in ("none", "checkpoint", "save_on_cpu", "phalanx@min"):
        run = only["variants"][name]
        assert "error" not in run, (name, run)
        assert run["device"] == "cuda" and run["peak_of"].startswith("device:")
        assert _positive(run["peak_bytes"]) and _positive(run["peak_device_bytes"])
        assert "peak_rss_bytes" not in run and run["allocator_control"] is False
    for name, run in only["variants"].items():
        assert "error" in run or _positive(run["peak_bytes"]), (name, run)
    summary = result["summary"]
    assert result["meta"]["losses_agree"], {
        name: row.get("max_loss_rel_diff_vs_none") for name, row in summary.items()
    }
    none = summary["none"]["median_peak_bytes"]
    assert summary["checkpoint"]["median_peak_bytes"] < none
    assert summary["save_on_cpu"]["median_peak_bytes"] < none
    assert "CUDA max_memory_allocated" in bench.format_report(result)
