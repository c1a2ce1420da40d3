"""The training loop behind ``phalanx train``: data, Engine, validation, metrics, checkpoints.

Runs in every rank (started by the launcher, by ``torchrun`` or as a world of one). Rank 0
writes the run directory: ``config.json``, ``metrics.jsonl`` (one record per step),
``checkpoints/`` and ``summary.json``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx import checkpoint
from phalanx.data.loader import ShardedBatches
from phalanx.data.sources import Dataset, load_source
from phalanx.engine import Engine
from phalanx.exchange.base import make_strategy
from phalanx.fields import option, require
from phalanx.metrics import JsonlWriter, Progress
from phalanx.models.layers import build_model
from phalanx.optim.factory import make_optimizer_factory
from phalanx.runtime.context import Context, init

if TYPE_CHECKING:
    from phalanx.config import RunConfig


@dataclass(kw_only=True)
class TrainConfig:
    """The loop: how long, how often to validate, log and where the run directory is."""

    steps: int = option(0, "optimizer steps to run (0: use epochs)")
    epochs: int = option(10, "epochs to run when steps = 0")
    accumulate_steps: int = option(1, "micro-batches per step; exchange only after the last")
    val_every: int = option(0, "validate every this many steps (0: only at the end)")
    seed: int = option(0, "model initialisation and dropout seed")
    run_dir: str = option("", "run directory (default: runs/<config name>-<time>)")
    progress: bool = option(True, "show a progress bar on rank 0")

    def __post_init__(self) -> None:
        require(self.steps >= 0, "steps", f"must be >= 0, got {self.steps}")
        require(self.epochs >= 0, "epochs", f"must be >= 0, got {self.epochs}")
        require(self.steps > 0 or self.epochs > 0, "steps", "set train.steps or train.epochs > 0")
        require(
            self.accumulate_steps >= 1,
            "accumulate_steps",
            f"must be >= 1, got {self.accumulate_steps}",
        )
        require(self.val_every >= 0, "val_every", f"must be >= 0, got {self.val_every}")


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the last dim; sequence outputs (B, T, C) are flattened."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Dataset, ctx: Context, batch_size: int = 256) -> float:
    """Validation accuracy over the whole validation set, each rank scoring a strided shard."""
    model.eval()
    x, y = data.x_val[ctx.rank :: ctx.world_size], data.y_val[ctx.rank :: ctx.world_size]
    counts = torch.zeros(2, dtype=torch.float64)
    for start in range(0, len(x), batch_size):
        logits = model(x[start : start + batch_size].to(ctx.device))
        target = y[start : start + batch_size].to(ctx.device)
        predicted = logits.reshape(-1, logits.shape[-1]).argmax(-1)
        counts[0] += (predicted == target.reshape(-1)).sum().item()
        counts[1] += target.numel()
    counts = counts.to(ctx.device)
    dist.all_reduce(counts, group=ctx.group)
    return float(counts[0] / counts[1])


class Trainer:
    """Builds everything a run needs from a RunConfig and runs the loop."""

    def __init__(self, config: RunConfig, run_dir: Path, resume: bool = False) -> None:
        self.config = config
        self.ctx = init(config.runtime)
        torch.manual_seed(config.train.seed)
        self.run_dir = Path(_agree(str(run_dir), self.ctx))
        self.data = load_source(config.data)
        self.loader = ShardedBatches(
            self.data.x_train,
            self.data.y_train,
            config.data.batch_size,
            self.ctx.rank,
            self.ctx.world_size,
            seed=config.data.seed,
            shuffle=config.data.shuffle,
        )
        self.engine = Engine(
            build_model(config.model),
            loss_fn,
            make_optimizer_factory(config.optimizer),
            exchange=make_strategy(config.exchange.strategy, config.exchange.options),
            bucket_mb=config.exchange.bucket_mb,
            accumulate_steps=config.train.accumulate_steps,
            context=self.ctx,
        )
        self.total_steps = config.train.steps or config.train.epochs * self.loader.steps_per_epoch
        self.step = 0
        if resume:
            self._restore()
        elif self.ctx.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            checkpoint.atomic_write_text(
                self.run_dir / "config.json", json.dumps(config.to_dict(), indent=2) + "\n"
            )
            (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)

    # -- loop ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        ctx, train = self.ctx, self.config.train
        is_main = ctx.is_main
        writer = JsonlWriter(self.run_dir / "metrics.jsonl") if is_main else None
        progress = Progress(self.total_steps, self.step, enabled=is_main and train.progress)
        global_batch = self.loader.global_batch
        train_time, accuracy, start_step = 0.0, float("nan"), self.step
        try:
            while self.step < self.total_steps:
                t0 = time.perf_counter()
                x, y = self.loader.next()
                loss = self._global_mean(self.engine.step(x, y))
                elapsed = time.perf_counter() - t0
                train_time += elapsed
                self.step += 1
                record = {"step": self.step, "loss": loss, "time_s": elapsed, **self._stats()}
                if self._due(train.val_every):
                    accuracy = evaluate(self.engine.module, self.data, ctx)
                    record["val_accuracy"] = accuracy
                    progress.write(f"step {self.step}: val accuracy {accuracy:.4f}")
                if writer:
                    writer.write(record)
                progress.update(loss, global_batch / elapsed)
                if self._due(self.config.checkpoint.every):
                    self._save()
        finally:
            progress.close()
            if writer:
                writer.close()
        if accuracy != accuracy:  # nothing validated yet (e.g. resumed at the end)
            accuracy = evaluate(self.engine.module, self.data, ctx)
        if self.config.checkpoint.every == 0 or self.step % self.config.checkpoint.every:
            self._save()
        steps_run = self.step - start_step
        summary = {
            "run_dir": str(self.run_dir),
            "steps": self.step,
            "world_size": ctx.world_size,
            "global_batch": global_batch,
            "val_accuracy": accuracy,
            "samples_per_s": steps_run * global_batch / train_time if train_time else 0.0,
            "train_time_s": train_time,
        }
        if is_main:
            checkpoint.atomic_write_text(
                self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n"
            )
        return summary

    def _due(self, every: int) -> bool:
        return self.step == self.total_steps or (every > 0 and self.step % every == 0)

    def _global_mean(self, loss: torch.Tensor) -> float:
        value = loss.detach().reshape(1).to(torch.float64)
        dist.all_reduce(value, group=self.ctx.group)
        return float(value.item() / self.ctx.world_size)

    def _stats(self) -> dict[str, Any]:
        stats = self.engine.stats
        return {
            "forward_s": stats.forward_s,
            "backward_s": stats.backward_s,
            "exchange_s": stats.exchange_s,
            "optimizer_s": stats.optimizer_s,
            "bytes_sent": stats.bytes_sent,
        }

    # -- checkpoints --------------------------------------------------------------------------
    def _save(self) -> None:
        rng = [None] * self.ctx.world_size
        dist.all_gather_object(rng, _rng_state(), group=self.ctx.group)
        engine_state = self.engine.state_dict()  # collective for sharded strategies
        if self.ctx.is_main:
            payload = {
                "step": self.step,
                "world_size": self.ctx.world_size,
                "engine": engine_state,
                "data": self.loader.state_dict(),
                "rng": rng,
            }
            checkpoint.save(
                self.run_dir / "checkpoints", self.step, payload, keep=self.config.checkpoint.keep
            )
        self.ctx.barrier()

    def _restore(self) -> None:
        payload = checkpoint.load(self.run_dir / "checkpoints")
        self.engine.load_state_dict(payload["engine"])
        self.loader.load_state_dict(payload["data"])
        self.step = int(payload["step"])
        states = payload["rng"]
        if len(states) == self.ctx.world_size:  # same world: every rank continues its stream
            _set_rng_state(states[self.ctx.rank])
        else:
            torch.manual_seed(self.config.train.seed + self.step + self.ctx.rank)
        if self.ctx.is_main:
            _truncate_metrics(self.run_dir / "metrics.jsonl", self.step)


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records past the resumed step (written after the checkpoint, before a crash)."""
    if not path.is_file():
        return
    kept = [
        line
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip() and json.loads(line).get("step", 0) <= step
    ]
    checkpoint.atomic_write_text(path, "".join(f"{line}\n" for line in kept))


def _agree(value: str, ctx: Context) -> str:
    """Rank 0's value of a string, on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=ctx.group)
    return box[0]
