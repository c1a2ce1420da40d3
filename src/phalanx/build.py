"""The composition root: every run built from a ``RunConfig`` is assembled here, in one place.

``phalanx train`` (the Trainer), ``--dry-run``, ``phalanx profile`` and ``phalanx plan`` call
these functions; no other module turns a config into a model, data, a loss, an optimizer, a
strategy, a memory manager or an Engine. Each function builds one part from the config and the
parts it needs, so a caller takes only what it uses (a dry run starts no process group).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from phalanx.data.pipeline import Pipeline
from phalanx.data.readers import training_reader
from phalanx.data.sources import Dataset, load_source
from phalanx.engine import Engine
from phalanx.errors import ConfigError, DataError
from phalanx.exchange.base import StrategyFactory, strategy_factory
from phalanx.losses import loss_fn
from phalanx.memory import measure
from phalanx.memory.manager import MemoryManager
from phalanx.memory.profile import MemoryProfile, pick_device, profile_model
from phalanx.models.config import build_model
from phalanx.optim.factory import Factory, make_optimizer_factory
from phalanx.precision import Precision
from phalanx.runtime.context import Context

if TYPE_CHECKING:
    from phalanx.config import RunConfig

__all__ = [
    "data",
    "engine",
    "loader",
    "loss_fn",
    "memory_manager",
    "step_peak",
    "model",
    "optimizer_factory",
    "profile_run",
    "sample_microbatch",
    "strategy",
]


def data(config: RunConfig) -> Dataset:
    """The ``[data]`` source, split into training and validation."""
    return load_source(config.data)


def model(config: RunConfig) -> nn.Module:
    """The ``[model]`` network (seed torch first for reproducible weights)."""
    return build_model(config.model)


def optimizer_factory(config: RunConfig) -> Factory:
    """``[optimizer]`` as a factory ``params -> Optimizer`` (strategies pass their shards)."""
    return make_optimizer_factory(config.optimizer)


def strategy(config: RunConfig) -> StrategyFactory:
    """The ``[exchange]`` strategy's factory, with its options."""
    return strategy_factory(config.exchange.strategy, config.exchange.options)


def sample_microbatch(config: RunConfig, data: Dataset) -> torch.Tensor | None:
    """One pipeline micro-batch of training inputs (tracing the stage boundaries), or None
    without ``[parallel]``."""
    if not config.parallel.enabled:
        return None
    size = config.data.batch_size // config.train.accumulate_steps
    return data.x_train[: size // config.parallel.num_microbatches]


def step_peak(config: RunConfig, device: torch.device) -> measure.StepPeak:
    """The meter of the peak ``[memory] budget_mb`` is held to, started now (before the memory
    manager profiles): with the memory manager on, freed host memory goes back to the OS from
    here on (``release_host_memory``), so the process's resident peak is the step's."""
    if config.memory.enabled and config.memory.release_host_memory:
        measure.release_freed_memory()
        measure.trim()
    return measure.StepPeak(device)


def memory_manager(
    config: RunConfig, model: nn.Module, data: Dataset, device: torch.device, world_size: int = 1
) -> MemoryManager | None:
    """``[memory]``'s plan applied to the model (profiled with one micro-batch), or None. Under
    a strategy that shards the parameters (``fsdp``) the plan counts this rank's share of the
    gradients and optimizer state over ``world_size`` ranks."""
    if not config.memory.enabled:
        return None
    if not isinstance(model, nn.Sequential):
        if config.memory.plans_layers:
            raise ConfigError("memory: the memory manager plans per layer of an nn.Sequential")
        model = nn.Sequential()  # optimizer = "host" alone needs no layers
    size = config.data.batch_size // config.train.accumulate_steps
    sample = (data.x_train[:size], data.y_train[:size])
    sharded = strategy_factory(
        config.exchange.strategy, config.exchange.options
    ).cls.shards_parameters
    return MemoryManager.build(
        list(model.children()), config.memory, device, sample, loss_fn,
        optimizer_factory(config), shards=world_size if sharded else 1,
    )  # fmt: skip


def engine(
    config: RunConfig,
    ctx: Context,
    model: nn.Module,
    data: Dataset,
    memory: MemoryManager | None,
) -> Engine:
    """The Engine of a config run: its strategy, exchange, guard, precision, pipeline, memory
    manager and traces, on ``ctx``."""
    return Engine(
        model,
        loss_fn,
        optimizer_factory(config),
        exchange=config.exchange,
        step=config.train,
        context=ctx,
        parallel=config.parallel,
        stages=config.stage_of_layers(),
        sample_input=sample_microbatch(config, data),
        memory=memory,
        trace=config.trace,
    )


def loader(config: RunConfig, data: Dataset, engine: Engine, device: torch.device) -> Pipeline:
    """The input pipeline of this rank: the training split sharded over the ranks that train
    (dedicated parameter servers don't)."""
    d = config.data
    return Pipeline(
        training_reader(d.path, data), d.batch_size, io_threads=d.io_threads,
        workers=d.workers, buffers=d.buffers, shuffle=d.shuffle, seed=d.seed, device=device,
        rank=engine.data_rank, world_size=engine.data_world_size,
    )  # fmt: skip


def _batches(config: RunConfig, steps: int) -> list[tuple[Any, Any]]:
    """The first ``steps`` batches of ``data.batch_size`` from the training split, in order."""
    reader = training_reader(config.data.path, data(config))
    size = config.data.batch_size
    if len(reader) == 0:
        raise DataError(f"data: {reader.name} has no training samples")
    batches = []
    for s in range(steps):
        indices = np.arange(s * size, (s + 1) * size) % len(reader)
        x, y = reader.read(indices)[:2]
        batches.append((x, y))
    return batches


def profile_run(config: RunConfig, steps: int = 3, device: str = "auto") -> MemoryProfile:
    """Profile a run's model, data, optimizer and precision on this process (first ``steps``
    batches of ``data.batch_size`` from the training split, in order; the first is the
    warm-up). The model must be a layer sequence (``[model] layers``, or a zoo model that is an
    nn.Sequential); any other module is profiled as one layer."""
    if steps < 1:
        raise ConfigError(f"--steps: must be >= 1, got {steps}")
    where = pick_device(device)
    if where.type == "cpu" and config.runtime.threads > 0:
        torch.set_num_threads(config.runtime.threads)  # as a training worker runs
    torch.manual_seed(config.train.seed)
    network = model(config)
    if isinstance(network, nn.Sequential):
        layers, names = list(network), [name for name, _ in network.named_children()]
    else:
        layers, names = [network], [type(network).__name__]
    batches = _batches(config, steps)
    precision = Precision(config.train.precision, where)
    return profile_model(
        layers,
        loss_fn,
        optimizer_factory(config),
        batches,
        where,
        names=names,
        autocast=precision.autocast,
    )
