"""Step statistics and where they go: the JSON-lines writer and the rank-0 progress bar, and
the optional views of a run (the ``viz`` extra: TensorBoard scalars beside metrics.jsonl,
``[log] tensorboard``; ``phalanx plot``'s curves). Without the extra, ``phalanx plot`` fails
with one line and a run's TensorBoard scalars are left out with one warning line."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from phalanx.errors import DataError, PhalanxError
from phalanx.fields import option
from phalanx.optional import optional


@dataclass
class StepStats:
    """Timings (seconds) and bytes of the last ``Engine.step``; ``exchange_s``: the exposed
    exchange (waiting after backward); ``input_*``: set by the trainer from the pipeline."""

    loss: float = float("nan")  # mean loss over all ranks (this rank's: Engine.step's return)
    forward_s: float = 0.0
    backward_s: float = 0.0
    exchange_s: float = 0.0
    optimizer_s: float = 0.0
    step_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    num_buckets: int = 0
    buckets_launched_in_backward: int = 0
    nonfinite_messages: int = 0  # compressed gradient messages that held inf/NaN (reported)
    nonfinite_skipped: bool = False  # the update was skipped: inf/NaN loss or gradients
    grad_norm: float = float("nan")  # global L2 norm of the mean gradient (when clipping)
    transfer_bytes: int = 0  # pipeline: bytes over this rank's transfer layers (fwd + bwd)
    input_wait_s: float = 0.0  # time the trainer blocked on the input pipeline (set by it)
    input_buffers_ready: int = 0  # pipeline buffers ready when the batch was asked for
    stop_requested: bool = False  # some rank called Engine.request_stop (same on every rank)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PhaseTimer:
    """Splits a step into named phases. CPU: wall clock; CUDA: events, resolved at ``read``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, Any]] = []

    def start(self) -> None:
        self._marks = [("start", self._now())]

    def mark(self, phase: str) -> None:
        """End of ``phase`` (the time since the previous mark)."""
        self._marks.append((phase, self._now()))

    def read(self) -> dict[str, float]:
        if self.cuda:
            self._marks[-1][1].synchronize()
        out: dict[str, float] = {}
        for (_, t0), (phase, t1) in zip(self._marks, self._marks[1:]):
            elapsed = t0.elapsed_time(t1) / 1e3 if self.cuda else t1 - t0
            out[phase] = out.get(phase, 0.0) + elapsed
        return out

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


class JsonlWriter:
    """Appends one JSON object per line; flushed per record so a crash keeps what was written."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class Progress:
    """A tqdm bar on rank 0 (silent elsewhere) showing loss, samples/s and ETA."""

    def __init__(self, total: int, initial: int, enabled: bool, desc: str = "train") -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True
            )

    def update(self, loss: float, samples_per_s: float, extra: str = "") -> None:
        if self._bar is None:
            return
        postfix = f"loss={loss:.4f} {samples_per_s:,.0f} samples/s"
        self._bar.set_postfix_str(postfix + (f" {extra}" if extra else ""), refresh=False)
        self._bar.update(1)

    def write(self, line: str, always: bool = False) -> None:
        """A line above the bar; ``always``: printed also when the bar is off."""
        if self._bar is not None:
            self._bar.write(line)
        elif always:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# -- the optional views of a run (the viz extra) ----------------------------------------------
HINT = "needs the 'viz' extra: pip install 'phalanx[viz]'"


@dataclass(kw_only=True)
class LogConfig:
    """Where step records go besides metrics.jsonl."""

    tensorboard: bool = option(
        False, "also write every step record as TensorBoard scalars to RUN_DIR/tensorboard"
    )


class MetricsWriter:
    """metrics.jsonl records as TensorBoard scalars (tag = the record's key, step = its step).
    Optional: where TensorBoard is missing or a write fails, one warning line, and the run goes
    on with metrics.jsonl alone."""

    def __init__(self, directory: Path) -> None:
        self._writer: Any = self._optional(lambda: _summary_writer(directory))

    def write(self, record: dict[str, Any]) -> None:
        if self._writer is not None:
            self._writer = self._optional(lambda: self._add(record))

    def _add(self, record: dict[str, Any]) -> Any:
        step = int(record["step"])
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self._writer.add_scalar(_tag(key), float(value), step)
        return self._writer

    def close(self) -> None:
        if self._writer is not None:
            self._writer = self._optional(self._writer.close)

    @staticmethod
    def _optional(run: Callable[[], Any]) -> Any:
        return optional(
            run,
            None,
            what="TensorBoard scalars not written",
            instead="metrics.jsonl alone kept (phalanx plot reads it)",
            again=f"log.tensorboard {HINT} and a writable run directory",
        )


def _summary_writer(directory: Path) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(directory))


def _tag(key: str) -> str:
    """Group TensorBoard's panels: train/loss, val/accuracy, time/backward_s, ..."""
    if key.startswith("val_"):
        return f"val/{key[4:]}"
    if key.endswith("_s"):
        return f"time/{key}"
    return f"train/{key}"


# -- phalanx plot --------------------------------------------------------------------------------
def read_run(run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """(metrics.jsonl records, global batch) of a run directory; DataError naming the file."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"{run_dir}: no metrics.jsonl (not a run directory?)")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            raise DataError(f"{path}:{number}: not a JSON record") from None
    summary = run_dir / "summary.json"
    batch = json.loads(summary.read_text())["global_batch"] if summary.is_file() else 0
    return records, int(batch)


def plot_runs(run_dirs: list[Path], output: Path) -> None:
    """Loss, validation and throughput per step of each run, one line per run, in one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PhalanxError(f"phalanx plot {HINT}") from None
    fig, (loss_ax, val_ax, speed_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
    for run_dir in run_dirs:
        records, batch = read_run(run_dir)
        label = run_dir.name
        steps = [r["step"] for r in records]
        loss_ax.plot(steps, [r["loss"] for r in records], label=label)
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        if val:
            val_ax.plot(*zip(*val), marker="o", label=label)
        if batch:
            speed = [batch / r["time_s"] if r.get("time_s") else math.nan for r in records]
            speed_ax.plot(steps, speed, label=label, linewidth=0.8)
    for ax, title, unit in ((loss_ax, "training loss", "loss"),
                            (val_ax, "validation loss", "loss"),
                            (speed_ax, "throughput", "samples/s")):  # fmt: skip
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
