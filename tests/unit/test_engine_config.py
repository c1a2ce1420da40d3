"""The Engine built from component Configs (issue 25): the keyword shorthand and the Configs are
one thing, checked once; a config run's [train] and [exchange] tables go in as they are; a
bucket rebuild builds a new strategy whole that takes over the old one's thread."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.config import config_from_data
from phalanx.errors import ConfigError
from tests.helpers.models import Reversed, batch

SGD = functools.partial(torch.optim.SGD, lr=0.1)
CE = nn.functional.cross_entropy


pytestmark = pytest.mark.usefixtures("fresh_world")  # no world of one before or after


def test_shorthand_and_configs_build_the_same_engine() -> None:
    exchange = px.ExchangeConfig(strategy="partitioned", bucket_mb=4.0, compress="fp16")
    step = px.StepConfig(accumulate_steps=2, precision="bf16", max_grad_norm=0.0)
    keywords = dict(bucket_mb=4.0, compress="fp16", accumulate_steps=2, precision="bf16")
    with px.Engine(nn.Linear(4, 3), CE, SGD, exchange=exchange, step=step) as by_config:
        with px.Engine(nn.Linear(4, 3), CE, SGD, exchange="partitioned", **keywords) as by_keywords:
            assert by_config.config == by_keywords.config
            assert type(by_config.strategy) is type(by_keywords.strategy)
            assert by_config.strategy.codec.name == by_keywords.strategy.codec.name == "fp16"
            assert by_config.buckets.bucket_bytes == by_keywords.buckets.bucket_bytes == 4 * 2**20


def test_a_keyword_replaces_one_key_of_the_config_and_is_checked_by_it() -> None:
    step = px.StepConfig(accumulate_steps=2, precision="bf16")
    with px.Engine(nn.Linear(4, 3), CE, SGD, step=step, accumulate_steps=4) as engine:
        assert (engine.config.accumulate_steps, engine.config.precision) == (4, "bf16")
    assert step.accumulate_steps == 2  # the caller's Config is not changed
    with pytest.raises(ConfigError, match="accumulate_steps: must be >= 1"):
        px.Engine(nn.Linear(4, 3), CE, SGD, step=step, accumulate_steps=0)
    with pytest.raises(ConfigError, match="precision: got 'fp8'"):
        px.Engine(nn.Linear(4, 3), CE, SGD, precision="fp8")


def test_a_runs_train_and_exchange_tables_go_in_as_they_are() -> None:
    config = config_from_data(
        {"train": {"steps": 3, "accumulate_steps": 2, "max_grad_norm": 1.0},
         "exchange": {"strategy": "tree", "bucket_mb": 2.0, "first_bucket_mb": 0.5}}
    )  # fmt: skip
    with px.Engine(nn.Linear(4, 3), CE, SGD, exchange=config.exchange, step=config.train) as e:
        assert e.config is config.train and e.accumulate_steps == 2
        assert e.guard.max_grad_norm == 1.0 and type(e.strategy).__name__ == "Tree"
        assert e.buckets.first_bucket_bytes == 2**19
        e.step(*batch())


@pytest.mark.parametrize("strategy", ["tree", "partitioned", "ps"])
def test_a_rebuild_builds_the_strategy_whole_and_hands_over_its_thread(strategy: str) -> None:
    """Layers registered in reverse: the observed order differs, so the buckets rebuild after
    the first update. The new strategy is a new object on the new layout, with the same
    communication thread; the old one is closed."""

    with px.Engine(Reversed(), CE, SGD, exchange=strategy, first_bucket_mb=0.0001) as engine:
        first, comm = engine.strategy, engine.strategy.comm
        assert comm is not None
        engine.step(*batch())
        assert engine.strategy is not first and engine.strategy.comm is comm
        assert first.comm is None and engine.strategy.buckets is engine.buckets.buckets
        threads = [t for t in threading.enumerate() if t.name.startswith("phalanx-comm")]
        assert len(threads) == 1  # one thread across layouts, none left behind
        engine.step(*batch())
    assert not any(t.name.startswith("phalanx-comm") for t in threading.enumerate())
