"""Every bench's flags come from its config's fields: parsing no flag gives the config's
defaults, and a flag sets its field (comma lists become tuples, --no-NAME turns a field off)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from phalanx.bench import load
from phalanx.bench.data import DataBenchConfig
from phalanx.bench.exchange import BenchConfig, strategy_contenders
from phalanx.bench.link import LinkBenchConfig
from phalanx.bench.memory_layers import MemoryBenchConfig
from phalanx.bench.optimizer import OptimizerBenchConfig
from phalanx.bench.pipeline import PipelineBenchConfig
from phalanx.bench.planner import PlannerBenchConfig
from phalanx.bench.port import PortBenchConfig
from phalanx.bench.rnn import RnnBenchConfig
from phalanx.bench.train_memory import TrainMemoryBenchConfig
from phalanx.cli import build_parser
from phalanx.commands.bench.flags import add_config_flags, config_from_args, config_from_flags
from phalanx.errors import ConfigError

PLAIN = {
    "rnn": RnnBenchConfig,
    "optimizer": OptimizerBenchConfig,
    "memory": TrainMemoryBenchConfig,
    "memory-layers": MemoryBenchConfig,
    "pipeline": PipelineBenchConfig,
    "port": PortBenchConfig,
    "planner": PlannerBenchConfig,
    "data": DataBenchConfig,
}


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def _config(target: str, *argv: str) -> Any:
    """A target's config from its flags, its own flags' values too (as the command builds it)."""
    return config_from_args(load().get(target)(), _args(target, *argv))


@pytest.mark.parametrize("target", sorted(PLAIN))
def test_no_flag_gives_the_configs_defaults(target: str) -> None:
    cls = PLAIN[target]
    assert config_from_flags(cls, _args(target)) == cls()


def test_the_custom_flags_keep_their_defaults() -> None:
    contenders = strategy_contenders(["allreduce"], ["none"], ["25"])
    assert _config("exchange") == BenchConfig(contenders=contenders)
    assert _config("link") == LinkBenchConfig()


def test_flags_set_their_fields() -> None:
    cfg = config_from_flags(
        PipelineBenchConfig, _args("pipeline", "--microbatches", "3, 6", "--schedules", "gpipe")
    )
    assert cfg.microbatches == (3, 6) and cfg.schedules == ("gpipe",)
    assert config_from_flags(DataBenchConfig, _args("data", "--no-train")).train is False
    assert config_from_flags(RnnBenchConfig, _args("rnn", "--hidden", "8")).hidden == 8
    assert _config("exchange", "--steps", "3").steps == 3
    assert _config("link", "--models", "none").models == ()


def test_a_list_flag_repeated_adds_to_itself() -> None:
    argv = ("planner", "--config", "a.toml", "--config", "b.toml,c.toml", "--worlds", "2")
    cfg = config_from_flags(PlannerBenchConfig, _args(*argv))
    assert cfg.config == ("a.toml", "b.toml", "c.toml") and cfg.worlds == (2,)


def test_a_wrong_list_item_is_one_line() -> None:
    with pytest.raises(ConfigError, match="--microbatches: 'x' is not a int"):
        config_from_flags(PipelineBenchConfig, _args("pipeline", "--microbatches", "2,x"))


def test_every_field_a_flag_can_carry_is_a_flag() -> None:
    """A new field of a bench config becomes a flag by itself (nothing to keep in step)."""

    @dataclasses.dataclass(frozen=True)
    class Config:
        count: int = 2
        names: tuple[str, ...] = ("a", "b")
        rate: float | None = None
        fast: bool = False
        extra: dict = dataclasses.field(default_factory=dict)  # no flag can carry it

    parser = argparse.ArgumentParser()
    add_config_flags(parser, Config)
    args = parser.parse_args(["--count", "5", "--names", "c", "--rate", "0.5", "--fast"])
    assert config_from_flags(Config, args) == Config(5, ("c",), 0.5, True)
    assert not hasattr(args, "extra")
