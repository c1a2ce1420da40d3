"""``phalanx bench optimizer``: both variants measured in this process on a tiny MLP; the report
and its checks."""

from __future__ import annotations

import pytest

from phalanx.bench.optimizer import (
    OptimizerBenchConfig,
    _check,
    format_report,
    measure_variant,
    summarize,
)
from phalanx.errors import ConfigError


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
    _check(result)
    report = format_report(result)
    assert "host vs device: peak" in report and "mirror vs device: peak" in report
    assert report.count("losses identical") == 2
    mirror["losses"][0] += 1.0
    result["summary"] = summarize(rounds)
    with pytest.raises(ConfigError, match="the mirror optimizer's losses differ"):
        _check(result)


def test_bad_flags() -> None:
    with pytest.raises(ConfigError, match="--chunk-mb: must be > 0"):
        OptimizerBenchConfig(chunk_mb=0).validate()
    with pytest.raises(ConfigError, match="--layers: must be >= 1"):
        OptimizerBenchConfig(layers=0).validate()
