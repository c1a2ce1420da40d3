"""Optional views of a run: TensorBoard scalars beside metrics.jsonl (``[log] tensorboard``)
and ``phalanx plot`` (loss, validation and throughput curves of one or several runs).

Both need the ``viz`` extra (``pip install 'phalanx[viz]'``: tensorboard, matplotlib); without
it ``phalanx plot`` fails with one line saying so, and a run's TensorBoard scalars are left out
with one warning line (the run goes on). Nothing else in phalanx imports them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.errors import DataError, PhalanxError
from phalanx.fields import option
from phalanx.optional import optional

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
