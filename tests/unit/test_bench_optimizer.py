"""``phalanx bench optimizer``: every variant measured in this process on a tiny MLP; the report
and its checks; ``--device`` refused in one line where it cannot run; on a GPU, the variants on
the device."""

from __future__ import annotations

import pytest
import torch

from phalanx.bench.optimizer import (
    VARIANTS,
    OptimizerBenchConfig,
    check,
    format_report,
    measure_variant,
    summarize,
)
from phalanx.errors import ConfigError
from tests.helpers.cli import assert_one_line_error, run_main


def test_variants_train_alike_and_the_host_one_holds_state_in_the_tier(tmp_path) -> None:
    cfg = OptimizerBenchConfig(
        width=64, layers=3, batch_size=4, chunk_mb=0.02, steps=2, peak_steps=1, threads=0,
        spill_dir=str(tmp_path),
    )  # fmt: skip
    variants = {v: measure_variant(cfg, v) for v in ("device", "host", "mirror")}
    device, host, mirror = variants["device"], variants["host"], variants["mirror"]
    assert host["losses"] == device["losses"] == mirror["losses"] and len(host["losses"]) == 5
    params = 3 * (64 * 64 + 64) * 4
    assert device["tier_bytes"] == 0 and host["tier_bytes"] == 2 * params  # Adam: two moments
    # masters, gradient buffers, two moments (and six 4-byte step counters)
    assert 4 * params <= mirror["tier_bytes"] <= 4 * params + 64
    assert host["chunks_per_step"] > 1 and mirror["chunks_per_step"] > 1
    rounds = [{"order": list(variants), "variants": variants}]
    result = {"meta": {"model": "MLP"}, "rounds": rounds, "summary": summarize(rounds)}
    check(result)
    report = format_report(result)
    assert "host vs device: peak" in report and "mirror vs device: peak" in report
    assert report.count("losses identical") == 2
    mirror["losses"][0] += 1.0
    result["summary"] = summarize(rounds)
    with pytest.raises(ConfigError, match="the mirror optimizer's losses differ"):
        check(result)


def test_bad_flags() -> None:
    with pytest.raises(ConfigError, match="--chunk-mb: must be > 0"):
        OptimizerBenchConfig(chunk_mb=0).validate()
    with pytest.raises(ConfigError, match="--layers: must be >= 1"):
        OptimizerBenchConfig(layers=0).validate()
    with pytest.raises(ConfigError, match="--device: 'tpu' is not one of cpu, cuda"):
        OptimizerBenchConfig(device="tpu").validate()


def test_an_unknown_device_is_one_line(capsys: pytest.CaptureFixture) -> None:
    assert run_main(["bench", "optimizer", "--device", "gpu"]) == 2
    assert_one_line_error(capsys.readouterr().err, "--device: 'gpu' is not one of cpu, cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_one_line(capsys: pytest.CaptureFixture) -> None:
    assert run_main(["bench", "optimizer", "--device", "cuda"]) == 2
    assert_one_line_error(capsys.readouterr().err, "--device cuda:", "use --device cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host tier)")
def test_on_cuda_host_and_mirror_lower_the_device_peak() -> None:
    """On a GPU, in this process: the peaks are CUDA's allocated bytes; ``host`` (Adam's state
    in pinned host memory) and ``mirror`` (masters and state on the host) hold less on the
    device than torch's Adam; the losses agree (the mirror's Adam runs on the CPU)."""
    cfg = OptimizerBenchConfig(
        width=512, layers=4, batch_size=8, chunk_mb=0.5, steps=2, warmup=1, peak_steps=1,
        threads=0, device="cuda",
    )  # fmt: skip
    variants = {v: measure_variant(cfg, v) for v in VARIANTS}
    for v, run in variants.items():
        assert run["device"] == "cuda" and run["peak_of"].startswith("device:"), v
        assert run["peak_bytes"] > 0 and "device_between_steps_bytes" in run, (v, run)
    params = 4 * (512 * 512 + 512) * 4
    assert variants["host"]["tier_bytes"] == 2 * params  # Adam's two moments, off the device
    device_peak = variants["device"]["peak_bytes"]
    assert variants["host"]["peak_bytes"] < device_peak, variants
    assert variants["mirror"]["peak_bytes"] < device_peak, variants
    rounds = [{"order": list(variants), "variants": variants}]
    summary = summarize(rounds, "cuda")
    assert all(summary["losses_agree"].values()), summary["max_loss_rel_diff"]
    result = {"meta": {"model": "MLP"}, "rounds": rounds, "summary": summary}
    check(result)
    assert "pinned host memory" in format_report(result)
