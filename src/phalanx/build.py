"""The composition root: no other module turns a ``RunConfig`` into a model, data, optimizer,
strategy, memory manager or Engine; one part per function, so a caller (a dry run starts no
process group) takes only what it uses."""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phalanx.data.pipeline import Pipeline
from phalanx.data.readers import training_reader
from phalanx.data.sources import Dataset, load_source
from phalanx.engine import Engine
from phalanx.errors import ConfigError
from phalanx.exchange.base import StrategyFactory, strategy_factory
from phalanx.losses import loss_fn
from phalanx.memory import host_cache, measure
from phalanx.memory.manager import PLAN_MARGIN, MemoryManager
from phalanx.memory.profile import MemoryProfile, pick_device, profile_model
from phalanx.models.config import build_model
from phalanx.models.layers import run_layers
from phalanx.optim.factory import Factory, make_optimizer_factory
from phalanx.precision import Precision
from phalanx.runtime.context import Context, current_context

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
    # FSDP2 warns when a unit returns a view, since an in-place op on it would skip the
    # unit's pre-backward all-gather; phalanx's layers never modify a layer's output in
    # place, so for a config's model the warning (once per unit and rank) is only noise.
    warnings.filterwarnings("ignore", message=_FSDP_VIEW_WARNING, category=UserWarning)
    return build_model(config.model)


_FSDP_VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"


def optimizer_factory(config: RunConfig) -> Factory:
    """``[optimizer]`` as a factory ``params -> Optimizer`` (strategies pass their shards)."""
    return make_optimizer_factory(config.optimizer)


def strategy(config: RunConfig) -> StrategyFactory:
    """The ``[exchange]`` strategy's factory, with its options."""
    return strategy_factory(config.exchange.strategy, config.exchange.options)


def shape_error(config: RunConfig, inputs: torch.Tensor) -> ConfigError | None:
    """Why the model cannot take ``inputs``, naming the layer, or None: a fresh CPU copy (no
    strategy hooks or collectives, so one rank may ask alone)."""
    if not config.model.layers:
        return None
    try:
        return run_layers(model(config), config.model.layers, inputs.detach().cpu())[1]
    except RuntimeError:  # not the layers' sizes (a whole-model failure): the run's own error
        return None


def sample_microbatch(config: RunConfig, data: Dataset) -> torch.Tensor | None:
    """One pipeline micro-batch of training inputs (tracing the stage boundaries), or None
    without ``[parallel]``."""
    if not config.parallel.enabled:
        return None
    size = config.data.batch_size // config.train.accumulate_steps
    return data.x_train[: size // config.parallel.num_microbatches]


def step_peak(config: RunConfig, device: torch.device) -> measure.StepPeak:
    """The meter of the peak ``[memory] budget_mb`` is held to, started before the manager
    profiles; freed host memory goes back to the OS from here on (or, with a CPU budget, to
    the host cache), so the resident peak is the step's."""
    if config.memory.releases_host_memory:
        measure.release_freed_memory()
        measure.trim()
    meter = measure.StepPeak(device)
    memory = config.memory  # the cache's evicted blocks go back to the OS only when released
    on_host = device.type == "cpu" and memory.releases_host_memory and meter.exact
    if memory.budget_mb and memory.host_cache and on_host:
        # freed tensors kept for reuse while the process stays under the budget, less the
        # plan's margin for what no allocator sees (the interpreter, small blocks' heap)
        host_cache.install(meter.start_bytes + int(memory.budget_mb * 2**20 * (1 - PLAN_MARGIN)))
    return meter


def memory_manager(
    config: RunConfig, model: nn.Module, data: Dataset, device: torch.device, world_size: int = 1
) -> MemoryManager | None:
    """``[memory]``'s plan applied to the model (profiled with one micro-batch), or None; under
    ``fsdp`` it counts this rank's share over ``world_size`` ranks."""
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


# ``phalanx profile`` / ``plan`` without --steps: warm up, then time steps until their spread
# is small (their IQR within SPREAD_TARGET of the median, over at least MIN_TIMED steps), at most
# MAX_TIMED of them, and past BUDGET_S seconds stop once MIN_TIMED_LATE steps are timed (a model
# of seconds per step still ends). Two warm-ups: the first step builds the optimizer's state and
# the allocator's pools, the second still ran ~10% slow here.
AUTO_WARMUP = 2
MIN_TIMED, MAX_TIMED, MIN_TIMED_LATE = 10, 50, 3
SPREAD_TARGET = 0.05
BUDGET_S = 15.0


class _Feed:
    """``steps`` batches from the run's own input pipeline, taken one per step as the trainer
    takes them (its ``next()`` between steps), with each input wait."""

    def __init__(self, pipeline: Pipeline, steps: int) -> None:
        self.pipeline, self.steps = pipeline, steps
        self.waits: list[float] = []

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Any:
        for _ in range(self.steps):
            x, y = self.pipeline.next()[:2]
            self.waits.append(self.pipeline.last_wait_s)
            yield x, y


def _until_stable() -> Any:
    """The auto profile's stop rule (see AUTO_WARMUP): called with the timed steps' seconds."""
    from phalanx.memory.profile import step_spread

    started = time.perf_counter()

    def done(step_s: list[float]) -> bool:
        spread = step_spread(step_s)
        if len(step_s) >= MIN_TIMED and spread is not None and spread <= SPREAD_TARGET:
            return True
        return len(step_s) >= MIN_TIMED_LATE and time.perf_counter() - started > BUDGET_S

    return done


def _as_a_worker(config: RunConfig, where: torch.device) -> None:
    """This process's intra-op threads and heap as ``phalanx.init`` sets a CPU worker's, so a
    profile measures the step ``phalanx train`` runs."""
    if where.type == "cpu" and config.runtime.threads > 0:
        torch.set_num_threads(config.runtime.threads)
    if where.type == "cpu" and config.runtime.reuse_host_memory:
        measure.reuse_freed_memory()


def profile_run(config: RunConfig, steps: int | None = None, device: str = "auto") -> MemoryProfile:
    """Profile a run's step on this process as ``phalanx train`` runs it (threads, optimizer,
    input pipeline). ``steps``: that many, the first a warm-up; None: until stable (AUTO_WARMUP).
    A model that is not an nn.Sequential is profiled as one layer."""
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps: must be >= 1, got {steps}")
    where = pick_device(device)
    _as_a_worker(config, where)
    torch.manual_seed(config.train.seed)
    network = model(config)
    if isinstance(network, nn.Sequential):
        layers, names = list(network), [name for name, _ in network.named_children()]
    else:
        layers, names = [network], [type(network).__name__]
    warmup = 1 if steps else AUTO_WARMUP
    d = config.data
    with Pipeline(
        training_reader(d.path, data(config)), d.batch_size, io_threads=d.io_threads,
        workers=d.workers, buffers=d.buffers, shuffle=d.shuffle, seed=d.seed, device=where,
        rank=0, world_size=1,
    ) as pipeline:  # fmt: skip
        feed = _Feed(pipeline, steps or AUTO_WARMUP + MAX_TIMED + 1)
        profile = profile_model(
            layers,
            loss_fn,
            optimizer_factory(config),
            feed,
            where,
            names=names,
            autocast=Precision(config.train.precision, where).autocast,
            warmup=warmup,
            until=None if steps else _until_stable(),
        )
    waits = feed.waits[warmup:][: len(profile.step_s)] or feed.waits
    profile.input_wait_s = statistics.median(waits)
    return profile


ENGINE_PASSES = 3  # passes over the configs, their order reversed every other pass
ENGINE_WARMUP = 3  # untimed steps of each Engine in each pass
ENGINE_STEPS, ENGINE_MIN_S = 10, 0.5  # timed, per config and pass: at least so many, so long
ENGINE_MAX_STEPS = 200  # a pass's timed steps at most (a step of microseconds)
ENGINE_PHASES = ("forward", "backward", "optimizer", "loop")


def engine_phases(configs: Sequence[RunConfig], device: str = "auto") -> list[dict[str, float]]:
    """Each config's Engine at world 1 over its input pipeline: medians (s) of its forward,
    backward, optimizer and whole ``loop`` step (what the per-layer profile misses). Measured
    in ``ENGINE_PASSES`` passes, order reversed every other one, so a shared machine's slow
    second lands in every config's steps (docs/planner.md)."""
    where = pick_device(device)
    samples: list[dict[str, list[float]]] = [{k: [] for k in ENGINE_PHASES} for _ in configs]
    for p in range(ENGINE_PASSES):
        order = list(range(len(configs)))
        for i in order if p % 2 == 0 else order[::-1]:
            _time_engine(configs[i], where, samples[i])
    return [{k: statistics.median(v) for k, v in times.items()} for times in samples]


def _time_engine(config: RunConfig, where: torch.device, times: dict[str, list[float]]) -> None:
    """One pass of ``engine_phases`` over one config: a fresh Engine, its warm-up, then its
    timed steps' phases appended to ``times``."""
    _as_a_worker(config, where)
    torch.manual_seed(config.train.seed)
    dataset = data(config)
    run = engine(config, current_context(), model(config).to(where), dataset, None)
    timed_s, num_timed = 0.0, 0
    try:
        with loader(config, dataset, run, where) as pipeline:
            for _ in range(ENGINE_WARMUP):
                run.step(*pipeline.next()[:2])
            while num_timed < ENGINE_MAX_STEPS and (
                num_timed < ENGINE_STEPS or timed_s < ENGINE_MIN_S
            ):
                started = time.perf_counter()
                x, y = pipeline.next()[:2]
                run.step(x, y)
                elapsed = time.perf_counter() - started
                times["loop"].append(elapsed)
                times["forward"].append(run.stats.forward_s)
                times["backward"].append(run.stats.backward_s)
                times["optimizer"].append(run.stats.optimizer_s)
                timed_s, num_timed = timed_s + elapsed, num_timed + 1
    finally:
        run.close()
