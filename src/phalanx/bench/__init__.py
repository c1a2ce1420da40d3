"""``phalanx bench`` targets: each runs phalanx and the PyTorch baseline in one invocation.

A target is one ``Bench`` in ``BENCHES``: its config class (whose fields are its flags), run,
check and format. ``phalanx.commands.bench`` wires every registered one the same way. The rest
of this module is what several benches measure or report alike."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from phalanx.errors import ConfigError
from phalanx.fileio import atomic_write_text
from phalanx.registry import Registry

T = TypeVar("T")
Result = dict[str, Any]


class Config(Protocol):
    def validate(self) -> None:
        """Raise ConfigError, in one line that names the flag, where a value cannot run."""


C = TypeVar("C", bound=Config)
# The modules that register a target each; imported by ``load()``, not by this package, so
# that importing one bench (phalanx.planner.calibrate imports bench.link) loads only that one.
MODULES = ("compile", "data", "exchange", "fsdp", "gpu", "link", "memory_layers", "optimizer",
           "pipeline", "planner", "port", "rnn", "strategy_memory", "train_memory")  # fmt: skip


def _no_flags(parser: argparse.ArgumentParser) -> None:
    return None


def _nothing_given(args: argparse.Namespace) -> dict[str, Any]:
    return {}


@dataclass(frozen=True, kw_only=True)
class Bench(Generic[C]):
    """One ``phalanx bench NAME``: ``config`` (a frozen dataclass whose fields are the flags,
    validated once, before the run), ``run`` (config -> result, a JSON-able dict whose
    ``meta.wall_s`` is the run's wall time), ``check`` (raises where the result holds an
    impossible number) and ``format`` (the printed report). A field no generic flag can carry
    is in ``skip`` and has its own flag from ``flags``; ``from_flags`` turns those flags into
    field values."""

    name: str
    help: str
    config: type[C]
    run: Callable[[C], Result]
    check: Callable[[Result], None]
    format: Callable[[Result], str]
    skip: tuple[str, ...] = ()
    flags: Callable[[argparse.ArgumentParser], None] = _no_flags
    from_flags: Callable[[argparse.Namespace], dict[str, Any]] = _nothing_given

    def report(self, cfg: C, json_path: str | None) -> int:
        """Validate ``cfg``, warn when the processes outnumber the cores, run, check, print the
        report and the wall time, write ``json_path`` atomically (never half-written)."""
        cfg.validate()
        cpus, nproc = os.cpu_count() or 1, getattr(cfg, "nproc", 1)
        if nproc > cpus:
            print(f"note: {nproc} processes on {cpus} CPUs are oversubscribed", file=sys.stderr)
        result = self.run(cfg)
        self.check(result)
        print(self.format(result))
        print(f"wall time {result['meta']['wall_s']:.1f} s")
        if json_path:
            atomic_write_text(Path(json_path), json.dumps(result, indent=2) + "\n")
        return 0


BENCHES: Registry[Bench[Any]] = Registry("bench target")


def register(
    name: str,
    help: str,
    config: type[C],
    run: Callable[[C], Result],
    check: Callable[[Result], None],
    format: Callable[[Result], str],
    **custom: Any,
) -> Bench[C]:
    """``phalanx bench NAME``, a ``Bench`` of these (``custom``: its ``skip``, ``flags`` and
    ``from_flags``), in ``BENCHES``."""
    bench = Bench(name=name, help=help, config=config, run=run, check=check, format=format,
                  **custom)  # fmt: skip
    BENCHES.register(name)(lambda: bench)
    return bench


def load() -> Registry[Bench[Any]]:
    """``BENCHES`` with every target registered."""
    for module in MODULES:
        importlib.import_module(f"phalanx.bench.{module}")
    return BENCHES


# -- what several benches share -----------------------------------------------------------------
def machine_meta(**extra: Any) -> dict[str, Any]:
    """What every benchmark records about the machine it ran on, then ``extra``."""
    import datetime
    import platform

    import torch

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        **extra,
    }


def load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def at_least(cfg: Any, least: float, *keys: str) -> None:
    """A config's check: every field in ``keys`` (None: not given) is at least ``least``."""
    for key in keys:
        value = getattr(cfg, key)
        if value is not None and value < least:
            raise ConfigError(f"--{key.replace('_', '-')}: must be >= {least}, got {value}")


def known(flag: str, given: Sequence[str], allowed: Sequence[str], what: str = "") -> None:
    """A config's check: ``given`` is not empty and names only what ``allowed`` holds."""
    unknown = [name for name in given if name not in allowed]
    if unknown or not given:
        bad = unknown[0] if unknown else ""
        raise ConfigError(f"{flag}: unknown {what}{bad!r}; known: {', '.join(allowed)}")


def rotate(items: Sequence[T], by: int) -> list[T]:
    """``items`` rotated left by ``by``: round r of an alternating benchmark starts with item r,
    so no contender always runs first (after the same neighbour, on a machine warming up)."""
    by %= len(items)
    return [*items[by:], *items[:by]]


def median_ratio(top: Sequence[float], bottom: Sequence[float]) -> float:
    """The median of the per-round ratios (rounds alternate, so each pair ran close in time)."""
    return statistics.median(a / b for a, b in zip(top, bottom))


def ratio_iqr(top: Sequence[float], bottom: Sequence[float]) -> tuple[float, float]:
    """The per-round ratios' interquartile range: how far this machine's noise reaches."""
    ratios = [a / b for a, b in zip(top, bottom)]
    if len(ratios) < 2:
        return ratios[0], ratios[0]
    quartiles = statistics.quantiles(ratios, n=4, method="inclusive")
    return quartiles[0], quartiles[-1]


def aligned(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """``rows`` of cells as lines, every column right-aligned to its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]


def synchronize(device: Any) -> None:
    """Wait for the device's queued work before a clock or a peak is read (no-op on a CPU)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def slowest_s(ctx: Any, work: Callable[[], object]) -> float:
    """Seconds of ``work`` on the slowest rank, started together after a barrier (a step is
    as slow as its slowest rank; a GPU's work is done when its queued kernels are)."""
    import torch
    import torch.distributed as dist

    dist.barrier(group=ctx.group)
    start = time.perf_counter()
    work()
    synchronize(ctx.device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=ctx.group)
    return float(elapsed.item())


def train_command(config: str | Path, run_dir: Path, sets: Sequence[str]) -> list[str]:
    """``phalanx train CONFIG`` in a fresh interpreter, one run directory, ``--set`` items."""
    command = [sys.executable, "-m", "phalanx", "train", str(config), "--run-dir", str(run_dir)]
    for item in sets:
        command += ["--set", item]
    return command


def step_times(run_dir: Path) -> list[float]:
    """Each step's seconds, from a ``phalanx train`` run's ``metrics.jsonl`` (rank 0's)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["time_s"] for line in lines if line]


def last_line(output: str, status: int) -> str:
    """What a failed process said last (its error), or its exit status when it said nothing."""
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {status}"
