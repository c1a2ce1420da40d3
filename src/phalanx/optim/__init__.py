"""Optimizers: the documents' AdaGrad (F5) and factories by name for configs."""

from phalanx.optim.adagrad import AdaGrad
from phalanx.optim.factory import OPTIMIZERS, OptimizerConfig, make_optimizer_factory

__all__ = ["OPTIMIZERS", "AdaGrad", "OptimizerConfig", "make_optimizer_factory"]
