"""The training loop behind ``phalanx train``: data, Engine, validation, metrics, checkpoints.

Runs in every rank (started by the launcher, by ``torchrun`` or as a world of one). Rank 0
writes the run directory: ``config.json``, ``metrics.jsonl`` (one record per step),
``checkpoints/`` and ``summary.json``.
"""

from __future__ import annotations

import datetime
import json
import math
import signal
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx import build, checkpoint
from phalanx.config import TrainConfig  # noqa: F401 (its home was here)
from phalanx.data.pipeline import Pipeline
from phalanx.data.sources import Dataset
from phalanx.errors import PhalanxError
from phalanx.fileio import atomic_write_text
from phalanx.losses import loss_fn  # noqa: F401 (its home was here)
from phalanx.memory import measure
from phalanx.metrics import JsonlWriter, MetricsWriter, Progress
from phalanx.models.modes import evaluating
from phalanx.optim.lr_schedule import build_scheduler
from phalanx.optional import optional
from phalanx.planner.prediction import prediction_summary
from phalanx.runtime.context import Context, init

if TYPE_CHECKING:
    from phalanx.config import RunConfig


PREEMPTED = "preempted.json"  # written when a SIGTERM stopped the run after a checkpoint


@torch.no_grad()
def evaluate(
    model: torch.nn.Module | Callable[[torch.Tensor], torch.Tensor | None],
    data: Dataset,
    ctx: Context,
    batch_size: int = 256,
    shard: tuple[int, int] | None = None,
    scores: bool | None = None,
) -> dict[str, float]:
    """Validation metrics over the whole validation set, each rank scoring a strided shard and
    the sums all-reduced: val_accuracy, val_loss (mean cross entropy per target) and, for
    sequence targets (N, T), val_perplexity = exp(val_loss).

    ``shard`` = (index, count) among the ranks that hold a trained model (default: all ranks);
    other ranks take part in the sum with nothing: ``scores = False``, or by default a rank
    numbered past the shard count (a dedicated parameter server).

    ``model`` may be a function returning logits, or None on ranks that hold no output (a
    pipeline's stages before the last one)."""
    with evaluating(model) if isinstance(model, torch.nn.Module) else nullcontext():
        return _evaluate(model, data, ctx, batch_size, shard, scores)


def _evaluate(
    model: Any,
    data: Dataset,
    ctx: Context,
    batch_size: int,
    shard: tuple[int, int] | None,
    scores: bool | None,
) -> dict[str, float]:
    index, count = shard or (ctx.rank, ctx.world_size)
    x, y = data.x_val[index::count], data.y_val[index::count]
    if scores is None:
        scores = shard is None or ctx.rank < count
    if not scores:  # a dedicated server scores nothing
        x, y = x[:0], y[:0]
    sums = torch.zeros(3, dtype=torch.float64)  # correct, targets, summed loss
    for start in range(0, len(x), batch_size):
        logits = model(x[start : start + batch_size].to(ctx.device))
        if logits is None:
            continue
        logits = logits.reshape(-1, logits.shape[-1])
        target = y[start : start + batch_size].to(ctx.device).reshape(-1)
        sums[0] += (logits.argmax(-1) == target).sum().item()
        sums[1] += target.numel()
        sums[2] += F.cross_entropy(logits, target, reduction="sum").item()
    sums = sums.to(ctx.device)
    dist.all_reduce(sums, group=ctx.group)
    metrics = {"val_accuracy": float(sums[0] / sums[1]), "val_loss": float(sums[2] / sums[1])}
    if data.y_val.dim() > 1:
        metrics["val_perplexity"] = math.exp(metrics["val_loss"])
    return metrics


def format_metrics(metrics: dict[str, float]) -> str:
    """'val accuracy 0.9500 | val loss 0.1234' (and perplexity when present)."""
    return " | ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in metrics.items())


class Trainer:
    """Builds everything a run needs from a RunConfig and runs the loop."""

    def __init__(self, config: RunConfig, run_dir: Path, resume: bool = False) -> None:
        self.config = config
        self.ctx = init(config.runtime)
        torch.manual_seed(config.train.seed)
        self.run_dir = Path(_agree(str(run_dir), self.ctx))
        self.data = build.data(config)
        model = build.model(config)
        self.peak = build.step_peak(config, self.ctx.device)
        self.memory = build.memory_manager(
            config, model, self.data, self.ctx.device, self.ctx.world_size
        )
        if self.memory is not None:
            measure.trim()  # the profile's freed blocks leave the heap before the first step
        self.engine = build.engine(config, self.ctx, model, self.data, self.memory)
        # Data is sharded over the ranks that train (dedicated parameter servers don't).
        self.shard = (self.engine.data_rank, self.engine.data_world_size)
        self.loader = build.loader(config, self.data, self.engine, self.ctx.device)
        self.total_steps = config.train.steps or config.train.epochs * self.loader.steps_per_epoch
        self.scheduler = build_scheduler(
            config.scheduler, self.engine.optimizer, self.total_steps
        )  # stepped once per optimizer step; its state goes into checkpoints
        self.step = 0
        self.preempted = False  # a SIGTERM arrived: checkpoint at the next step boundary, stop
        self._threshold_saved = False  # bucket_mb = "auto": its choice is in the run directory
        self._pending_save: Any = None  # checkpoint.async_save's save in flight
        self._async_group: Any = None  # the process group of background saves, once needed
        self._async_failed = False  # a background save failed: the foreground from then on
        if resume:
            self._restore()
        elif self.ctx.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / PREEMPTED).unlink(missing_ok=True)
            atomic_write_text(
                self.run_dir / "config.json", json.dumps(config.to_dict(), indent=2) + "\n"
            )
            (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)

    # -- loop ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        ctx, train = self.ctx, self.config.train
        is_main = ctx.is_main
        writer = JsonlWriter(self.run_dir / "metrics.jsonl") if is_main else None
        board = (
            MetricsWriter(self.run_dir / "tensorboard")
            if is_main and self.config.log.tensorboard
            else None
        )
        progress = Progress(self.total_steps, self.step, enabled=is_main and train.progress)
        global_batch = self.loader.global_batch
        train_time, metrics, start_step = 0.0, {}, self.step
        step_times: list[float] = []  # each step's wall time (the plan's prediction's measure)
        if is_main and self.engine.pipeline is not None and self.step == 0:
            progress.write(self.engine.pipeline.describe())
        if is_main and self.memory is not None and self.step == 0:
            progress.write(self.memory.describe(), always=True)
        restore_handler = self._catch_sigterm()
        try:
            while self.step < self.total_steps and not self.preempted:
                t0 = time.perf_counter()
                x, y = self.loader.next()
                self.engine.trace.input(t0, time.perf_counter())
                try:
                    self.engine.step(x, y)  # its stats: the global mean loss and any stop vote
                except RuntimeError as e:  # a layer's sizes wrong in the config: name it
                    if self.step > start_step or isinstance(e, PhalanxError):
                        raise
                    if (wrong := build.shape_error(self.config, x)) is not None:
                        raise wrong from e
                    raise
                loss, self.preempted = self.engine.stats.loss, self.engine.stats.stop_requested
                lr = self.engine.optimizer.param_groups[0]["lr"]  # the rate this step used
                if self.scheduler is not None:
                    self.scheduler.step()
                tracer = self.engine.trace.tracer
                if tracer is not None and tracer.written is not None and is_main:
                    progress.write(f"trace of steps: {tracer.written} (open in ui.perfetto.dev)")
                    tracer.written = None
                self.engine.stats.input_wait_s = self.loader.last_wait_s
                self.engine.stats.input_buffers_ready = self.loader.last_ready
                elapsed = time.perf_counter() - t0
                train_time += elapsed
                step_times.append(elapsed)
                self.step += 1
                if self.step == start_step + 1 and self.engine.compile_s is not None and is_main:
                    progress.write(self._compile_line(elapsed), always=True)
                record = {"step": self.step, "loss": loss, "time_s": elapsed, **self._stats()}
                record["lr"] = lr
                chosen = self._threshold_chosen_now()
                if chosen is not None and is_main:
                    progress.write(f"step {self.step}: {chosen[0]}")
                    progress.write(f"step {self.step}: {chosen[1]}")
                if self._due(train.val_every):
                    metrics = self._evaluate()
                    record.update(metrics)
                    progress.write(f"step {self.step}: {format_metrics(metrics)}")
                if writer:
                    writer.write(record)
                if board:
                    board.write(record)
                progress.update(
                    loss, global_batch / elapsed, f"lr {lr:.3g}, {_input_text(self.loader)}"
                )
                if self._due(self.config.checkpoint.every) or self.preempted:
                    self._save()
        finally:
            restore_handler()
            self.loader.close()
            progress.close()
            if writer:
                writer.close()
            if board:
                board.close()
        if self.preempted:
            return self._stop_preempted(start_step, train_time)
        if not metrics:  # nothing validated yet (e.g. resumed at the end)
            metrics = self._evaluate()
        if self.config.checkpoint.every == 0 or self.step % self.config.checkpoint.every:
            self._save()
        steps_run = self.step - start_step
        summary = {
            "run_dir": str(self.run_dir),
            "steps": self.step,
            "world_size": ctx.world_size,
            "global_batch": global_batch,
            **metrics,
            "samples_per_s": steps_run * global_batch / train_time if train_time else 0.0,
            "train_time_s": train_time,
            "nonfinite_steps": self.engine.guard.num_nonfinite_steps,
            "compile_s": self.engine.compile_s,  # this rank's (0's); None without compile
            **self._memory_summary(),
            **prediction_summary(self.run_dir, step_times),
        }
        if is_main:
            atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary

    def _compile_line(self, first_step_s: float) -> str:
        """``[train] compile``, once after the first step (where torch compiles)."""
        compiled = self.engine.compiled
        kinds = sorted({type(layer).__name__ for layer in compiled})
        return (
            f"compile: {len(compiled)} layers ({', '.join(kinds)}) compiled in "
            f"{self.engine.compile_s:.1f} s of the first step's {first_step_s:.1f} s"
        )

    def _memory_summary(self) -> dict[str, Any]:
        """The measured peak above the start (the largest over the ranks; collective), next to
        the budget: one meaning of peak, ``measure.StepPeak``'s."""
        peak = torch.tensor([0.0], dtype=torch.float64, device=self.ctx.device)
        peak[0] = float(self.peak.peak_bytes())
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.ctx.group)
        mib = float(2**20)
        return {
            "memory_peak_mb": float(peak.item()) / mib,
            "memory_start_mb": self.peak.start_bytes / mib,
            "memory_budget_mb": self.config.memory.budget_mb or None,
            "memory_peak_of": "cuda allocated" if self.ctx.device.type == "cuda" else "resident",
        }

    def _evaluate(self) -> dict[str, float]:
        """Validation on the trained model: the module, or the pipeline stage by stage."""
        pipeline = self.engine.pipeline
        model = self.engine.forward_module if pipeline is None else pipeline.forward
        # In batches of the training micro-batch: validation then holds less than a step does
        # (no saved activations), so it stays within the memory the run was planned for.
        size = self.config.data.batch_size // self.config.train.accumulate_steps
        scores = self.engine.is_trainer
        return evaluate(model, self.data, self.ctx, size, shard=self.shard, scores=scores)

    def _threshold_chosen_now(self) -> tuple[str, str] | None:
        """bucket_mb = "auto" just chose its threshold: keep the link fit and the choice in the
        run directory; returns (the choice, what the trials measured) once, else None."""
        auto = self.engine.auto
        if auto is None or auto.threshold is None or not auto.done or self._threshold_saved:
            return None
        self._threshold_saved = True
        if self.ctx.is_main and auto.link is not None:
            auto.link.save(self.run_dir)
            record = {**auto.threshold.to_dict(), "measured": auto.trials_text}
            record["kept_bucket_bytes"] = self.engine.buckets.bucket_bytes
            atomic_write_text(self.run_dir / "threshold.json", json.dumps(record, indent=2) + "\n")
        return auto.threshold.describe(), auto.trials_text

    def _due(self, every: int) -> bool:
        return self.step == self.total_steps or (every > 0 and self.step % every == 0)

    def _catch_sigterm(self) -> Any:
        """A scheduler's preemption (SIGTERM) asks for a checkpoint at the next step boundary;
        returns the function that puts the previous handler back."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = signal.getsignal(signal.SIGTERM)

        def request_stop(signum: int, frame: Any) -> None:
            self.engine.request_stop()

        signal.signal(signal.SIGTERM, request_stop)
        return lambda: signal.signal(signal.SIGTERM, previous)

    def _stop_preempted(self, start_step: int, train_time: float) -> dict[str, Any]:
        """After the preemption checkpoint: record it for the launcher, return a summary."""
        summary = {
            "run_dir": str(self.run_dir),
            "steps": self.step,
            "world_size": self.ctx.world_size,
            "preempted": True,
            "train_time_s": train_time,
            "steps_run": self.step - start_step,
        }
        if self.ctx.is_main:
            atomic_write_text(self.run_dir / PREEMPTED, json.dumps(summary, indent=2) + "\n")
        return summary

    def _stats(self) -> dict[str, Any]:
        stats = self.engine.stats
        return {
            "forward_s": stats.forward_s,
            "backward_s": stats.backward_s,
            "exchange_s": stats.exchange_s,
            "optimizer_s": stats.optimizer_s,
            "bytes_sent": stats.bytes_sent,
            "input_wait_s": stats.input_wait_s,
            "input_buffers_ready": stats.input_buffers_ready,
            "nonfinite_skipped": stats.nonfinite_skipped,
            **({"grad_norm": stats.grad_norm} if self.config.train.max_grad_norm else {}),
            **({"transfer_bytes": stats.transfer_bytes} if self.engine.pipeline else {}),
        }

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self, stored: dict[str, Any] | None = None) -> dict[str, Any]:
        """This rank's part of the run's state, for torch.distributed.checkpoint (Trainer is
        Stateful: ``dcp.save({"trainer": trainer}, planner=checkpoint.SavePlanner())``): the
        step, the Engine's part, the input position, the scheduler and this rank's random
        streams. ``stored``: a checkpoint's structure about to be loaded (see
        ``checkpoint.restore``); the result then says what this rank reads."""
        rank = str(self.ctx.rank)
        if stored is None:
            return {
                "step": self.step,
                "world_size": self.ctx.world_size,
                "engine": self.engine.state_dict(),
                "data": self.loader.state_dict(),
                "scheduler": (None if self.scheduler is None else self.scheduler.state_dict(),),
                "rng": {rank: _rng_state()},  # every rank its own streams
            }
        small = {k: checkpoint.template(v) for k, v in stored.items() if k not in ("engine", "rng")}
        streams = stored.get("rng", {})
        if len(streams) == self.ctx.world_size and rank in streams:  # same world: continue them
            small["rng"] = {rank: checkpoint.template(streams[rank])}
        return {**small, "engine": self.engine.state_dict(stored=stored.get("engine", {}))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state["engine"])
        self.loader.load_state_dict(state["data"])
        (scheduler,) = state.get("scheduler") or (None,)
        if self.scheduler is not None and scheduler is not None:
            self.scheduler.load_state_dict(scheduler)
        self.step = int(state["step"])
        mine = (state.get("rng") or {}).get(str(self.ctx.rank))
        if mine is not None and int(state.get("world_size", 0)) == self.ctx.world_size:
            _set_rng_state(mine)  # same world: every rank continues its stream
        else:
            torch.manual_seed(self.config.train.seed + self.step + self.ctx.rank)

    def _save(self) -> None:
        """Every rank writes its own part of the checkpoint. With ``checkpoint.async_save`` a
        background thread writes it while training goes on (one at a time); the run's last
        checkpoint (and a preemption's) is written before ``_save`` returns."""
        directory, keep = self.run_dir / "checkpoints", self.config.checkpoint.keep
        self._finish_pending_save()
        last = self.step >= self.total_steps or self.preempted
        if self.config.checkpoint.async_save and not last and not self._async_failed:
            self._pending_save = checkpoint.save_async(
                directory, self.step, {"trainer": self}, keep=keep, group=self._save_group()
            )
        else:
            checkpoint.save(
                directory, self.step, {"trainer": self}, keep=keep, group=self.ctx.group
            )

    def _finish_pending_save(self) -> None:
        """Wait for the background save in flight. Background saving is optional: one that
        failed is a warning line, and from then on every rank saves in the foreground (the
        ranks agree, so that their saves' collectives match)."""
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return
        failed = optional(
            lambda: pending.wait() is None,  # it returns a Path: False, not failed
            True,
            what="a background checkpoint not written",
            instead="checkpoints written in the foreground from now on",
            again="the next run saves in the background again (checkpoint.async_save)",
        )
        flag = torch.tensor([float(failed)], device=self.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctx.group)
        self._async_failed = self._async_failed or bool(flag.item())

    def _save_group(self) -> Any:
        """The process group of background saves (their collectives run on their thread)."""
        if self._async_group is None:
            timeout = datetime.timedelta(seconds=self.config.runtime.timeout_s)
            self._async_group = dist.new_group(backend="gloo", timeout=timeout)
        return self._async_group

    def _restore(self) -> None:
        checkpoint.restore(
            self.run_dir / "checkpoints",
            {"trainer": self},
            group=self.ctx.group,
            warn=self.ctx.is_main,
            legacy=lambda payload: self.load_state_dict(_from_single_file(payload)),
        )
        if self.ctx.is_main:
            (self.run_dir / PREEMPTED).unlink(missing_ok=True)
            _truncate_metrics(self.run_dir / "metrics.jsonl", self.step)


def _from_single_file(payload: dict[str, Any]) -> dict[str, Any]:
    """A single-file checkpoint of earlier versions (rank 0 saved everything) in the form
    ``Trainer.load_state_dict`` takes."""
    streams = payload.get("rng") or []
    return {
        **payload,
        "world_size": len(streams),
        "scheduler": (payload.get("scheduler"),),
        "rng": {str(r): state for r, state in enumerate(streams)},
    }


def _input_text(loader: Pipeline) -> str:
    """Input wait and buffer occupancy for the progress bar."""
    wait_ms, ready = loader.last_wait_s * 1e3, loader.last_ready
    return f"input wait {wait_ms:.1f} ms, {ready}/{loader.num_buffers} ready"


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
    atomic_write_text(path, "".join(f"{line}\n" for line in kept))


def _agree(value: str, ctx: Context) -> str:
    """Rank 0's value of a string, on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=ctx.group)
    return box[0]
