"""Step statistics, the JSON-lines metrics writer and the rank-0 progress bar."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch


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
