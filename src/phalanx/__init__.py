"""phalanx: train PyTorch models on many devices at once.

import phalanx as px
ctx = px.init()
engine = px.Engine(model, loss_fn, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
loss = engine.step(inputs, targets)
"""

from phalanx.config import RunConfig, load_config
from phalanx.engine import Engine
from phalanx.engine.config import StepConfig
from phalanx.errors import CheckpointError, ConfigError, DataError, PhalanxError, WorkerError
from phalanx.exchange import STRATEGIES, ExchangeConfig, Strategy
from phalanx.runtime.context import Context, init, shutdown
from phalanx.runtime.pool import WorkerPool, current_worker

__version__ = "0.1.0"

__all__ = [
    "STRATEGIES",
    "CheckpointError",
    "ConfigError",
    "Context",
    "DataError",
    "Engine",
    "ExchangeConfig",
    "PhalanxError",
    "RunConfig",
    "StepConfig",
    "Strategy",
    "WorkerError",
    "WorkerPool",
    "current_worker",
    "init",
    "load_config",
    "shutdown",
]
