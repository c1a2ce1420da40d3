"""``phalanx bench strategy-memory`` runs every contender in fresh processes at each world size
and reports each rank's peak, its ratio to DDP's, the formula and the targets (the figures
themselves are measured runs, in docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from phalanx.bench.strategy_memory import StrategyMemoryConfig, format_table, run_benchmark
from phalanx.cli import build_parser
from phalanx.commands.bench.flags import config_from_flags
from phalanx.errors import ConfigError


def test_bench_strategy_memory_reports_every_world_and_contender_per_rank() -> None:
    cfg = StrategyMemoryConfig(model="mlp", hidden=32, worlds=(2, 3), batch_size=2, steps=2,
                               rounds=1, contenders=("ddp", "partitioned", "fsdp"))  # fmt: skip
    result = run_benchmark(cfg)
    assert list(result["worlds"]) == ["2", "3"]
    assert result["meta"]["state_bytes"] == 2 * result["meta"]["param_bytes"]  # AdamW
    for world, data in result["worlds"].items():
        p, rows = int(world), data["rows"]
        assert list(rows) == ["ddp", "partitioned", "fsdp"]
        for row in rows.values():
            assert len(row["peak"]) == p and all(x > 0 for x in row["peak"] + row["held"])
            assert row["vs_ddp"] == [a / b for a, b in zip(row["peak"], rows["ddp"]["peak"])]
            assert row["saving"] == [b - a for a, b in zip(row["peak"], rows["ddp"]["peak"])]
            assert len(row["formula_state"]) == p and row["step_vs_ddp"] > 0
        assert rows["ddp"]["vs_ddp"] == [1.0] * p and rows["ddp"]["step_vs_ddp"] == 1.0
        target = data["targets"]["partitioned"]
        assert {target["memory"]["passed"], target["speed"]["passed"]} <= {True, False}
    table = format_table(result)
    assert "world 3:" in table and "1.00x/1.00x/1.00x" in table
    assert "target, partitioned, memory: " in table


def test_the_resnet_script_runs_too() -> None:
    cfg = StrategyMemoryConfig(contenders=("ddp", "ps"), width=4, image_size=16, batch_size=2,
                               steps=2, rounds=1)  # fmt: skip
    rows = run_benchmark(cfg)["worlds"]["2"]["rows"]
    assert rows["ps"]["formula_state"] == [rows["ps"]["formula_state"][0]] * 2
    assert all(p > 0 for row in rows.values() for p in row["peak"])


def test_an_unknown_contender_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"--contenders: fdsp; choose from ddp, allreduce"):
        StrategyMemoryConfig(contenders=("ddp", "fdsp")).validate()


def test_its_flags_are_its_fields() -> None:
    def parse(*argv: str) -> StrategyMemoryConfig:
        args = build_parser().parse_args(["bench", "strategy-memory", *argv])
        return config_from_flags(StrategyMemoryConfig, args)

    assert parse() == StrategyMemoryConfig()
    assert parse("--contenders", "ddp,ps", "--steps", "3") == StrategyMemoryConfig(
        contenders=("ddp", "ps"), steps=3
    )
    assert parse("--model", "mlp", "--worlds", "2,3") == StrategyMemoryConfig(
        model="mlp", worlds=(2, 3)
    )
