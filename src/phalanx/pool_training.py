"""The document's training flow (F15) on a WorkerPool, the phalanx Engine in every worker
(docs/pool.md); ``train_on_pool`` does it in one call."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from phalanx.data.loader import epoch_order
from phalanx.engine import Engine
from phalanx.exchange.base import OptimizerFactory
from phalanx.fields import option, require
from phalanx.losses import loss_fn as sequence_loss
from phalanx.models.modes import evaluating
from phalanx.runtime.pool import WorkerPool, current_worker

ModelFactory = Callable[[], torch.nn.Module]
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


@dataclass(kw_only=True)
class PoolTrainConfig:
    """How every worker trains on its block of the data."""

    batch_size: int = option(32, "samples per worker per step (global batch = this x workers)")
    seed: int = option(0, "model initialisation and shuffle seed (same on every worker)")
    shuffle: bool = option(True, "reshuffle each block every epoch (one permutation for all)")
    exchange: str = option("allreduce", "the Engine's exchange strategy")
    bucket_mb: float = option(25.0, "the Engine's fusion threshold in MiB")

    def __post_init__(self) -> None:
        require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        require(self.bucket_mb > 0, "bucket_mb", f"must be > 0, got {self.bucket_mb}")


@dataclass
class BlockBatches:
    """Batches of one worker's block (CPU): every worker takes the same positions of
    ``block_order(epoch)`` in its own block, so a step's global batch is their concatenation."""

    x: torch.Tensor
    y: torch.Tensor
    batch_size: int
    config: PoolTrainConfig
    epoch: int = 0
    step: int = 0

    def __post_init__(self) -> None:
        self.steps_per_epoch = len(self.x) // self.batch_size
        self.order = block_order(len(self.x), self.config, 0)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
            self.order = block_order(len(self.x), self.config, self.epoch)
        index = self.order[self.step * self.batch_size : (self.step + 1) * self.batch_size]
        self.step += 1
        return self.x[index], self.y[index]


@dataclass
class Replica:
    """One worker's side of a PoolTrainer, kept in ``current_worker().state.<name>``."""

    engine: Any  # phalanx.Engine
    config: PoolTrainConfig
    batches: BlockBatches | None = None


def block_order(size: int, config: PoolTrainConfig, epoch: int) -> torch.Tensor:
    """The sample order of every block in ``epoch``: a permutation seeded by seed + epoch."""
    return epoch_order(size, config.seed, epoch, config.shuffle)


def split_blocks(
    inputs: torch.Tensor, targets: torch.Tensor, num_blocks: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Contiguous equal blocks (the remainder of ``len // num_blocks`` is dropped)."""
    size = len(inputs) // num_blocks
    blocks = [slice(r * size, (r + 1) * size) for r in range(num_blocks)]
    return [(inputs[block], targets[block]) for block in blocks]


# -- functions that run in the workers ----------------------------------------------------------
def _init_replica(
    name: str,
    make_model: ModelFactory,
    loss_fn: LossFn,
    optimizer: OptimizerFactory,
    config: PoolTrainConfig,
) -> int:
    worker = current_worker()
    torch.manual_seed(config.seed)
    exchange, bucket_mb = config.exchange, config.bucket_mb
    engine = Engine(
        make_model(),
        loss_fn,
        optimizer,
        exchange=exchange,
        bucket_mb=bucket_mb,
        context=worker.context,
    )
    setattr(worker.state, name, Replica(engine=engine, config=config))
    return sum(p.numel() for p in engine.module.parameters())


def _replica(name: str) -> Replica:
    return getattr(current_worker().state, name)


def _set_block(block: tuple[torch.Tensor, torch.Tensor], name: str) -> int:
    replica = _replica(name)
    replica.batches = BlockBatches(*block, replica.config.batch_size, replica.config)
    return len(block[0])


def _train_steps(name: str, steps: int) -> list[float]:
    """``steps`` Engine steps on this worker's block; this worker's loss per step."""
    replica = _replica(name)
    assert replica.batches is not None, "scatter() before train()"
    return [float(replica.engine.step(*replica.batches.next())) for _ in range(steps)]


@torch.no_grad()
def _score(block: tuple[torch.Tensor, torch.Tensor], name: str, batch_size: int) -> list[float]:
    """Summed loss, correct predictions and count over this worker's share of the data."""
    module = _replica(name).engine.module
    device = current_worker().device
    sums = [0.0, 0.0, 0.0]
    x, y = block
    with evaluating(module):  # each submodule's own mode back after (a frozen BatchNorm too)
        for start in range(0, len(x), batch_size):
            out = module(x[start : start + batch_size].to(device))
            target = y[start : start + batch_size].to(device).reshape(-1)
            logits = out.reshape(-1, out.shape[-1])
            sums[0] += float(F.cross_entropy(logits, target, reduction="sum"))
            sums[1] += float((logits.argmax(-1) == target).sum())
            sums[2] += target.numel()
    return sums


def _model_state(keep: bool, name: str) -> dict[str, torch.Tensor] | None:
    """Every worker takes part (``fsdp`` gathers the rows each holds); ``keep``: the one whose
    copy travels back."""
    state = _replica(name).engine.full_state_dict()
    return {k: v.detach().clone() for k, v in state.items()} if keep else None


def _drop(name: str) -> None:
    replica = _replica(name)
    replica.engine.close()
    delattr(current_worker().state, name)


# -- the controller side ------------------------------------------------------------------------
class PoolTrainer:
    """Synchronous data-parallel training driven from the controller (F15).
    Phase 1: every worker builds the model with the same seed in an Engine.
    Phase 2 (``scatter``): one contiguous block of the data each.
    Phase 3 (``train``): one pool call for all steps.
    Phase 4: the mean of the per-step losses (equal batches: the global mean)."""

    _count = 0

    def __init__(
        self,
        pool: WorkerPool,
        make_model: ModelFactory,
        *,
        optimizer: OptimizerFactory,
        loss_fn: LossFn = sequence_loss,
        config: PoolTrainConfig | None = None,
        name: str | None = None,
    ) -> None:
        PoolTrainer._count += 1
        self.pool = pool
        self.config = config or PoolTrainConfig()
        self.name = name or f"trainer{PoolTrainer._count}"
        # Phase 1: the model-initialisation function goes to every worker.
        counts = pool.run(_init_replica, self.name, make_model, loss_fn, optimizer, self.config)
        self.num_params = counts[0]
        self.steps_per_epoch = 0

    def scatter(self, inputs: torch.Tensor, targets: torch.Tensor) -> int:
        """Phase 2: send each worker its block: inputs (N, ...) and targets (N, ...), CPU
        tensors. Returns the block size (samples per worker)."""
        if len(inputs) != len(targets):
            raise ValueError(f"scatter: {len(inputs)} inputs but {len(targets)} targets")
        blocks = split_blocks(inputs, targets, self.pool.num_workers)
        size = len(blocks[0][0])
        if size < self.config.batch_size:
            raise ValueError(
                f"scatter: a block of {size} samples per worker is smaller than "
                f"batch_size {self.config.batch_size}"
            )
        self.pool.run_each(_set_block, blocks, self.name)
        self.steps_per_epoch = size // self.config.batch_size
        return size

    def train(self, steps: int) -> list[float]:
        """Phase 3 and 4: ``steps`` synchronous steps; the global mean loss of each step."""
        if steps < 1:
            raise ValueError(f"train: steps must be >= 1, got {steps}")
        if self.steps_per_epoch == 0:
            raise ValueError("train: call scatter(inputs, targets) first")
        per_rank = self.pool.run(_train_steps, self.name, steps)
        return [sum(losses) / len(losses) for losses in zip(*per_rank)]

    def evaluate(
        self, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int = 256
    ) -> dict[str, float]:
        """Loss, accuracy and perplexity (exp(loss)) over the whole set, each worker scoring
        a strided share: {"loss", "accuracy", "perplexity"}."""
        n = self.pool.num_workers
        shares = [(inputs[r::n], targets[r::n]) for r in range(n)]
        sums = [sum(col) for col in zip(*self.pool.run_each(_score, shares, self.name, batch_size))]
        loss = sums[0] / sums[2]
        return {"loss": loss, "accuracy": sums[1] / sums[2], "perplexity": math.exp(loss)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0's model state on the CPU (every replica holds the same parameters)."""
        keep = [r == 0 for r in range(self.pool.num_workers)]
        state = self.pool.run_each(_model_state, keep, self.name)[0]
        assert state is not None
        return state

    def close(self) -> None:
        """Drop the replicas from the workers (the pool stays open)."""
        if not self.pool.closed:
            self.pool.run(_drop, self.name)


@dataclass
class PoolTrainResult:
    losses: list[float]  # global mean loss per step
    state_dict: dict[str, torch.Tensor]  # the final model (rank 0's; all replicas are equal)


def train_on_pool(
    pool: WorkerPool,
    make_model: ModelFactory,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    steps: int,
    optimizer: OptimizerFactory,
    loss_fn: LossFn = sequence_loss,
    config: PoolTrainConfig | None = None,
) -> PoolTrainResult:
    """The whole flow in one call: initialise every worker, scatter, train, collect."""
    trainer = PoolTrainer(pool, make_model, optimizer=optimizer, loss_fn=loss_fn, config=config)
    try:
        trainer.scatter(inputs, targets)
        losses = trainer.train(steps)
        return PoolTrainResult(losses, trainer.state_dict())
    finally:
        trainer.close()
