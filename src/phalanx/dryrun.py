"""What ``phalanx train CONFIG --dry-run`` prints: the resolved config, the model with its
parameter counts and the layout of the run, with nothing started (no process group, no
workers, no run directory)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from phalanx.data.readers import training_reader
from phalanx.models.layers import run_layers
from phalanx.parallel.pipeline import (
    describe_stages,
    pipelined_view,
    split_here,
    trace_boundaries,
)
from phalanx.parallel.pipeline_schedules import schedule_kind

if TYPE_CHECKING:
    from phalanx.config import RunConfig


def describe_run(config: RunConfig, world_size: int, run_dir: str) -> str:
    """Lines a user reads before starting a run (builds the model and opens the data)."""
    from phalanx import build

    model = build.model(config)
    pipeline_lines: list[str]
    shown, pipeline_lines = model, []
    if config.parallel.enabled:
        shown, pipeline_lines = _pipeline(config, model, world_size)
    shapes = _shapes(config, model)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    replicas = world_size // config.parallel.pipeline
    data_ranks = build.strategy(config).num_trainers(replicas)
    servers = replicas - data_ranks
    global_batch = config.data.batch_size * data_ranks
    num_samples = len(training_reader(config.data.path, build.data(config)))
    steps_per_epoch = num_samples // global_batch
    steps = config.train.steps or config.train.epochs * steps_per_epoch
    exchange = config.exchange
    lines = [
        "resolved config:",
        json.dumps(config.to_dict(), indent=2),
        "",
        "model:",
        str(shown),
        f"parameters: {total:,} ({trainable:,} trainable, {4 * trainable / 2**20:.2f} MiB fp32)",
        *shapes,
        "",
        "layout:",
        f"  processes: {world_size} ({data_ranks} training on data"
        + (f", {servers} parameter servers)" if servers else ")"),
        *pipeline_lines,
        f"  exchange: {exchange.strategy}, bucket_mb {exchange.bucket_mb}, "
        f"compress {exchange.compress}, options {exchange.options or '{}'}",
        f"  global batch: {config.data.batch_size} x {data_ranks} = {global_batch}",
        f"  steps: {steps} ({num_samples:,} training samples, {steps_per_epoch} steps per epoch)",
        f"  optimizer: {config.optimizer.name}, lr {config.optimizer.lr}; "
        f"schedule: {config.scheduler.name}"
        + (f" after {config.scheduler.warmup_steps} warm-up steps"
           if config.scheduler.warmup_steps else ""),
        f"  checkpoints: every {config.checkpoint.every or 'run end'}, "
        f"keep {config.checkpoint.keep}",
        f"  run directory: {run_dir}",
        "dry run: nothing was started",
    ]  # fmt: skip
    return "\n".join(lines)


def _shapes(config: RunConfig, model: Any) -> list[str]:
    """One batch of the training inputs through the configured layers (``run_layers``): the
    line with the input and output shapes, or the one-line ConfigError naming the first layer
    whose sizes do not fit (what the run's first step would hit)."""
    import torch

    from phalanx import build

    if not config.model.layers:
        return []
    inputs = build.data(config).x_train[: config.data.batch_size // config.train.accumulate_steps]
    if not len(inputs):  # no samples to try (the shapes show in the run's first step)
        return []
    output, wrong = run_layers(model, config.model.layers, inputs)
    if wrong is not None:
        raise wrong
    shape = list(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
    return [f"shapes: one batch {list(inputs.shape)} -> output {shape}"]


def _pipeline(config: RunConfig, model: Any, world_size: int) -> tuple[Any, list[str]]:
    """The model with its transfer layers, and the layout lines of a pipelined run."""
    import torch

    from phalanx import build

    parallel = config.parallel
    if config.runtime.threads > 0:  # time layers for split = "auto" as a worker would
        torch.set_num_threads(config.runtime.threads)
    layers = list(model.children())
    sample = build.sample_microbatch(config, build.data(config))
    assert sample is not None  # [parallel] is enabled here
    given = config.stage_of_layers()
    stage_of, measured = (given, "") if given else split_here(layers, parallel, sample)
    boundaries = trace_boundaries(layers, stage_of, sample)
    kind = schedule_kind(parallel.schedule)
    m, p = parallel.num_microbatches, parallel.pipeline
    bubble = kind.bubble_fraction(p, m, parallel.stages_per_rank)
    # Zero-bubble figures hold only when forward, input and weight backward take equal time.
    claim = "bubble claimed if F = I = W" if kind.split_backward else "bubble in theory"
    lines = [
        f"  pipeline: {world_size // p} replica(s) x {p} pipeline ranks, "
        f"{parallel.num_stages} stages, schedule {parallel.schedule}, {m} micro-batches of "
        f"{len(sample)} ({claim} {100 * bubble:.1f}%)",
        *([f"  split = auto measured: {measured}"] if measured else []),
        describe_stages(stage_of, boundaries, parallel.rank_of_stage),
    ]
    return pipelined_view(layers, stage_of, boundaries, parallel.rank_of_stage), lines
