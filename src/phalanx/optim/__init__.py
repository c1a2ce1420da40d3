"""Optimizers: factories by name for configs (the owner-side AdaGrad arrives with F5)."""

from phalanx.optim.factory import OPTIMIZERS, OptimizerConfig, make_optimizer_factory

__all__ = ["OPTIMIZERS", "OptimizerConfig", "make_optimizer_factory"]
