"""Optimizer factories from config: ``params -> torch.optim.Optimizer``, registered by name."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from phalanx.fields import option, require
from phalanx.optim.adagrad import AdaGrad
from phalanx.registry import Registry

Factory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: Registry[Factory] = Registry("optimizer")


@dataclass(kw_only=True)
class OptimizerConfig:
    """The optimizer and its hyper-parameters (unused ones are ignored by optimizers without)."""

    name: str = option("sgd", "registered optimizer: sgd, adam, adamw, adagrad")
    lr: float = option(0.05, "learning rate")
    momentum: float = option(0.9, "SGD momentum")
    weight_decay: float = option(0.0, "L2 penalty (decoupled for adamw)")
    rho: float = option(1e-8, "AdaGrad: lr_i = lr / sqrt(rho + sum of squared gradients_i)")

    def __post_init__(self) -> None:
        known = ", ".join(OPTIMIZERS.names())
        require(self.name in OPTIMIZERS, "name", f"unknown optimizer {self.name!r}; known: {known}")
        require(0 < self.lr < math.inf, "lr", f"must be finite and > 0, got {self.lr}")
        require(0 <= self.momentum < 1, "momentum", f"must be in [0, 1), got {self.momentum}")
        require(self.rho > 0, "rho", f"must be > 0, got {self.rho}")
        require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")


@OPTIMIZERS.register("sgd")
def _sgd(config: OptimizerConfig) -> Factory:
    return functools.partial(
        torch.optim.SGD, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )


@OPTIMIZERS.register("adam")
def _adam(config: OptimizerConfig) -> Factory:
    return functools.partial(torch.optim.Adam, lr=config.lr, weight_decay=config.weight_decay)


@OPTIMIZERS.register("adagrad")
def _adagrad(config: OptimizerConfig) -> Factory:
    return functools.partial(
        AdaGrad, lr=config.lr, rho=config.rho, weight_decay=config.weight_decay
    )


@OPTIMIZERS.register("adamw")
def _adamw(config: OptimizerConfig) -> Factory:
    return functools.partial(torch.optim.AdamW, lr=config.lr, weight_decay=config.weight_decay)


def make_optimizer_factory(config: OptimizerConfig) -> Factory:
    return OPTIMIZERS.get(config.name)(config)
