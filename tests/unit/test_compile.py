"""``compile``: which modules are compiled, where forward waits, the one-line refusals and the
option's way from ``[train]`` to the Engine. Nothing here runs a compiled forward (slow on a CPU;
tests/multiproc/test_compile.py trains compiled)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.compile import compile_layers, forward_waiters, layers_of
from phalanx.config import config_from_data
from phalanx.errors import ConfigError
from phalanx.exchange.allreduce import AllReduce
from phalanx.exchange.base import StrategyFactory

SGD = functools.partial(torch.optim.SGD, lr=0.1)
CE = nn.functional.cross_entropy


pytestmark = pytest.mark.usefixtures("fresh_world")  # no world of one before or after


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_the_layers_are_the_top_level_children_through_containers() -> None:
    net = Net()
    assert layers_of(net) == [net.embed, net.blocks[0], net.blocks[1], net.head]
    single = nn.Linear(4, 3)
    assert layers_of(single) == [single]  # no children: compiled whole


def test_inside_a_compiled_layer_only_the_layer_waits_for_its_subtree() -> None:
    net = Net()
    eager = {id(m): [id(p) for p in ps] for m, ps in forward_waiters(net)}
    assert id(net.blocks[0].fc) in eager and id(net.blocks[0]) not in eager
    compile_layers(net)
    waiters = [(m, ps) for m, ps in forward_waiters(net)]
    assert [m for m, _ in waiters] == layers_of(net)
    block, params = waiters[1]
    assert [id(p) for p in params] == [id(p) for p in block.parameters()]
    assert compile_layers(net) == []  # once


def test_a_copy_of_a_compiled_layer_runs_its_own_eager_forward() -> None:
    net = Net()
    compile_layers(net)
    twin = copy.deepcopy(net)
    assert twin.head.forward.__self__ is twin.head
    with torch.no_grad():  # without gradients the compiled layers run eagerly: no compile here
        x = torch.randn(2, 4)
        assert torch.equal(twin(x), net(x))


def test_train_compile_reaches_the_engine_and_compile_s_is_none_without_it() -> None:
    config = config_from_data({"train": {"steps": 1, "compile": True}})
    assert config.train.compile is True
    with px.Engine(Net(), CE, SGD, step=config.train) as engine:
        assert engine.config.compile and len(engine.compiled) == 4
        assert engine.compile_s == 0.0  # nothing compiled before the first step
    with px.Engine(Net(), CE, SGD) as engine:
        assert engine.compiled == [] and engine.compile_s is None


def test_a_model_compiled_whole_is_refused_in_one_line() -> None:
    for model in (torch.compile(Net()), Net()):
        if isinstance(model, Net):
            model.head.compile()
        with pytest.raises(ConfigError, match="already compiled") as err:
            px.Engine(model, CE, SGD, compile=True)
        assert "\n" not in str(err.value) and "pass the module itself" in str(err.value)


class NoCompile(AllReduce):
    @classmethod
    def compile_model(cls, config: object, module: nn.Module) -> list[nn.Module]:
        raise ConfigError("train.compile: nocompile cannot run compiled; set compile = false")


def test_a_strategy_refuses_compile_by_name_before_anything_is_built() -> None:
    factory = StrategyFactory("nocompile", NoCompile, None)
    with pytest.raises(ConfigError, match="nocompile cannot run compiled"):
        px.Engine(Net(), CE, SGD, exchange=factory, compile=True)
    px.Engine(Net(), CE, SGD, exchange=factory).close()  # without compile it trains
