"""``phalanx bench fsdp`` runs every contender on each user script and reports step time, the
ratios to torch's own FSDP2 loop and to DDP, and the bytes per rank (the figures themselves
are measured runs, in docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from phalanx.bench.fsdp import DEFAULT_KINDS, FsdpBenchConfig, format_table, run_benchmark
from phalanx.bench.fsdp_scripts import SCRIPTS, Sizes, parameters_of
from phalanx.errors import ConfigError

TINY = {"nproc": 2, "vocab": 64, "width": 32, "num_layers": 2, "seq_len": 8, "batch_size": 2,
        "image_size": 16, "steps": 1, "rounds": 2, "warmup": 1}  # fmt: skip


def test_bench_fsdp_reports_every_contender_and_sharded_bytes() -> None:
    result = run_benchmark(FsdpBenchConfig(**TINY))  # type: ignore[arg-type]
    rows = result["rows"]
    assert tuple(rows) == DEFAULT_KINDS
    assert all(len(r["seconds"]) == 2 and r["step_s"] > 0 for r in rows.values())
    # parameters, gradients and state: sharded (fsdp, torch's) about half of replicated
    for sharded in ("fsdp", "fsdp2"):
        assert rows[sharded]["held_mib"] < 0.6 * rows["allreduce"]["held_mib"], rows
    assert rows["fsdp"]["held_mib"] == rows["fsdp2"]["held_mib"]  # the same shards
    table = format_table(result)
    assert "vs fsdp2" in table and "fsdp vs torch's FSDP2 loop" in table


@pytest.mark.parametrize("model", ["resnet", "lora", "mlp"])
def test_bench_fsdp_against_ddp_on_each_script(model: str) -> None:
    cfg = FsdpBenchConfig(**{**TINY, "model": model, "contenders": ("ddp", "fsdp")})  # type: ignore[arg-type]
    result = run_benchmark(cfg)
    rows = result["rows"]
    assert tuple(rows) == ("ddp", "fsdp")
    assert rows["ddp"]["time_vs_ddp"] == 1.0 and rows["fsdp"]["time_vs_ddp"] > 0
    lo, hi = rows["fsdp"]["time_vs_ddp_range"]
    assert lo <= rows["fsdp"]["time_vs_ddp"] <= hi
    # sharded: below DDP's replica (the LoRA base stays whole on every rank, as in DDP)
    assert rows["fsdp"]["held_mib"] <= rows["ddp"]["held_mib"], rows
    table = format_table(result)
    assert "time / ddp's" in table and "fsdp's step time / DDP's" in table
    assert "vs fsdp2" not in table


def test_the_scripts_are_what_they_say() -> None:
    sizes = Sizes(vocab=64, width=32, num_layers=2, seq_len=8, batch_size=2, image_size=16)
    params, trainable = parameters_of(SCRIPTS["resnet"].build(sizes))
    assert params == trainable == 11_689_512  # torchvision's resnet18
    params, trainable = parameters_of(SCRIPTS["lora"].build(sizes))
    assert 0 < trainable < params / 10  # the adapters only
    with pytest.raises(ConfigError, match="--model: got 'vgg'"):
        FsdpBenchConfig(model="vgg").validate()
    with pytest.raises(ConfigError, match="--contenders: got \\['zero'\\]"):
        FsdpBenchConfig(contenders=("zero",)).validate()
