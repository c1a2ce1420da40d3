"""``phalanx bench strategy-memory`` runs every contender in fresh processes and reports each
rank's peak and its ratio to DDP's (the figures themselves are measured runs, in
docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from phalanx.bench.strategy_memory import StrategyMemoryConfig, format_table, run_benchmark
from phalanx.cli import build_parser
from phalanx.commands.bench.flags import config_from_flags
from phalanx.errors import ConfigError


def test_bench_strategy_memory_reports_every_contender_per_rank() -> None:
    cfg = StrategyMemoryConfig(contenders=("ddp", "partitioned", "ps"), width=4, image_size=16,
                               batch_size=2, steps=2, rounds=2)  # fmt: skip
    result = run_benchmark(cfg)
    rows = result["rows"]
    assert list(rows) == ["ddp", "partitioned", "ps"]
    assert all(len(runs) == 2 and len(runs[0]) == 2 for runs in result["runs"].values())
    for row in rows.values():
        assert len(row["peak"]) == 2 and all(p > 0 for p in row["peak"])
        assert row["vs_ddp"] == [a / b for a, b in zip(row["peak"], rows["ddp"]["peak"])]
        assert all(h > 0 for h in row["held"])
    assert rows["ddp"]["vs_ddp"] == [1.0, 1.0]
    table = format_table(result)
    assert "partitioned" in table and "1.00x/1.00x" in table


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
