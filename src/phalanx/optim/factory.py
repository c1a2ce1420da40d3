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
        OPTIMIZERS.require_known(self.name, "name")
        require(0 < self.lr < math.inf, "lr", f"must be finite and > 0, got {self.lr}")
        require(0 <= self.momentum < 1, "momentum", f"must be in [0, 1), got {self.momentum}")
        require(self.rho > 0, "rho", f"must be > 0, got {self.rho}")
        require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")


def _partial(cls: Callable[..., torch.optim.Optimizer], *keys: str) -> Callable[..., Factory]:
    """A registered factory: ``cls`` with lr, weight_decay and ``keys`` from the config."""
    names = ("lr", *keys, "weight_decay")
    return lambda config: functools.partial(cls, **{k: getattr(config, k) for k in names})


_TABLE = (("sgd", torch.optim.SGD, ("momentum",)), ("adam", torch.optim.Adam, ()),
          ("adagrad", AdaGrad, ("rho",)), ("adamw", torch.optim.AdamW, ()))  # fmt: skip
for _name, _cls, _keys in _TABLE:
    OPTIMIZERS.register(_name)(_partial(_cls, *_keys))


def make_optimizer_factory(config: OptimizerConfig) -> Factory:
    return OPTIMIZERS.get(config.name)(config)
