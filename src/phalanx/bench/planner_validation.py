"""``phalanx bench planner --config A.toml --config B.toml ...``: the planner validated the way
users use it, before the run (issue 28); nothing from the measured runs feeds the predictions.

Phases (docs/bench-methods.md, "planner --config"; docs/planner.md, "Before the run"):
  Phase 1 (calibrate, once): this machine's cached cluster calibration.
  Phase 2 (predict, per config, right before its cells): a one-process profile, the slow-down
    probed after it, ``make_plan`` for every cell.
  Phase 3 (measure, right after): each cell one ``phalanx train CONFIG --nproc N`` process.
Phases 2 and 3 alternate per config: this shared VM's speed drifts 10-30% within an hour."""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx import bench as common
from phalanx.config import load_config
from phalanx.errors import ConfigError
from phalanx.planner.calibrate import load_or_calibrate, slowdown_now
from phalanx.planner.plan import make_plan, threshold_of
from phalanx.planner.prediction import measured_step_s
from phalanx.planner.step import measure_step_profile

MEDIAN_TARGET, WORST_TARGET = 0.10, 0.20  # on the held-back half (issue 28)
HALVES = ("calibration", "held_back")
FAILURE_LINES = 40  # of a failed cell's output, kept in the JSON (failure_log) for its cause


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One measured and predicted setup of one config."""

    config: str
    world: int
    strategy: str
    compress: str

    def sets(self) -> list[str]:
        return [f"exchange.strategy={self.strategy}", f"exchange.compress={self.compress}"]

    def key(self) -> str:
        return f"{Path(self.config).stem} {self.world} {self.strategy}/{self.compress}"


def half_of(path: str) -> str:
    """The half a config belongs to: the name of its directory if that is a half's name."""
    parent = Path(path).parent.name
    return parent if parent in HALVES else "given"


def cells_of(cfg: Any, path: str) -> list[Cell]:
    """Every cell of one config: world 1 under its own setup, then each world above 1 under
    every strategy and compression the strategy can run (the plan says which it refuses)."""
    config = load_config(path)
    out = []
    if 1 in cfg.worlds:
        strategy, compress = config.exchange.strategy, config.exchange.compress or "none"
        out.append(Cell(config=path, world=1, strategy=strategy, compress=compress))
    for world in (w for w in cfg.worlds if w > 1):
        out += [
            Cell(config=path, world=world, strategy=s, compress=c)
            for s in cfg.strategies
            for c in cfg.compress
            if not (s == "fsdp" and c != "none")  # fsdp has no codec (refused in one line)
        ]
    return out


def predict(cfg: Any, path: str, cluster: Any) -> tuple[dict[str, float], dict[str, Any]]:
    """Phase 2, as ``phalanx plan CONFIG`` does it: a one-process profile, the compute
    slow-down probed right after it (``slowdown_now``), each cell's predicted step (by
    ``Cell.key``); and what was measured. With ``cfg.cached_slowdown`` (a diagnostic),
    ``about`` also holds each cell's prediction with the cached calibration's slow-down
    (``predicted_cached``)."""
    config = load_config(path)
    profile = measure_step_profile(config, strategies=cfg.strategies)
    now = slowdown_now(cluster, say=lambda line: None)
    about: dict[str, Any] = {
        "one_process_step_s": profile.compute_s,
        "spread": profile.spread,
        "probed_slowdown": list(now.compute_slowdown),
    }
    predicted = _predicted_cells(cfg, path, config, profile, now)
    if cfg.cached_slowdown:
        about["predicted_cached"] = _predicted_cells(cfg, path, config, profile, cluster)
    return predicted, about


def _predicted_cells(
    cfg: Any, path: str, config: Any, profile: Any, cluster: Any
) -> dict[str, float]:
    """Each cell's predicted step (seconds, by ``Cell.key``) on ``cluster``."""
    threshold = threshold_of(config.exchange)
    strategies = sorted({*cfg.strategies, config.exchange.strategy})
    compressions = sorted({*cfg.compress, config.exchange.compress})
    setups = [(s, dict(config.exchange.options) if s == config.exchange.strategy else {})
              for s in strategies]  # fmt: skip
    rows = []
    for world in cfg.worlds:  # every world on this one host, as phalanx train --nproc runs it
        here = cluster.on_one_host(world)
        plan = make_plan(profile, here, [world], setups, (threshold,), compressions)
        rows += plan.rows
    predicted = {}
    for row in rows:
        if row.result is None:
            continue
        cell = Cell(config=path, world=row.devices, strategy=row.setup.strategy,
                    compress=row.setup.compress)  # fmt: skip
        predicted[cell.key()] = row.result.step_s
    return predicted


def measure(cfg: Any, cell: Cell, run_dir: Path) -> float | str:
    """Phase 3: one ``phalanx train`` process of the cell; its measured step (seconds), or
    what it failed with: the last ``FAILURE_LINES`` lines of its output, the one line last."""
    sets = [f"train.steps={cfg.train_steps}", "train.progress=false", "train.val_every=0",
            "checkpoint.every=0", *cell.sets()]  # fmt: skip
    command = [*common.train_command(cell.config, run_dir, sets), "--nproc", str(cell.world)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=cfg.timeout_s)
    except subprocess.TimeoutExpired:
        return f"no result in {cfg.timeout_s:.0f} s"
    if done.returncode != 0 or not (run_dir / "metrics.jsonl").is_file():
        lines = (done.stdout + done.stderr).strip().splitlines()
        return "\n".join(lines[-FAILURE_LINES:]) if lines else f"exit {done.returncode}"
    return measured_step_s(common.step_times(run_dir))


def run_validation(cfg: Any) -> dict[str, Any]:
    """Every phase over every config; one row per cell."""
    started = time.perf_counter()
    calibration = load_or_calibrate(False)  # Phase 1
    cells = {path: cells_of(cfg, path) for path in cfg.config}
    rounds: dict[str, list[tuple[float, float]]] = {
        c.key(): [] for group in cells.values() for c in group
    }  # per cell, each round's (predicted, measured) step
    cached: dict[str, list[tuple[float, float]]] = {key: [] for key in rounds}  # diagnostic
    failed: dict[str, str] = {}
    profiles: dict[str, list[dict[str, Any]]] = {path: [] for path in cfg.config}
    with tempfile.TemporaryDirectory(prefix="phalanx-validate-") as tmp:
        for r in range(cfg.rounds):
            forward = r % 2 == 0  # the order reversed every other round
            for path in cfg.config if forward else cfg.config[::-1]:
                # Phase 2: as a user runs `phalanx plan CONFIG`, right before its runs.
                predicted, about = predict(cfg, path, calibration.cluster)
                profiles[path].append(about)
                one = about["one_process_step_s"] * 1e3
                slow = about.get("probed_slowdown", [])
                probe = f", compute slow-down at 2 probed now {slow[1]:.3f}" if slow[1:] else ""
                _say(f"round {r + 1}: predicted {Path(path).stem}: one process {one:.1f} ms{probe}")
                order = cells[path] if forward else cells[path][::-1]
                for i, cell in enumerate(order):  # Phase 3
                    value = measure(cfg, cell, Path(tmp) / f"r{r}-{cell.key()}".replace(" ", "_"))
                    if isinstance(value, str):
                        failed[cell.key()] = value
                    elif cell.key() in predicted:
                        rounds[cell.key()].append((predicted[cell.key()], value))
                        if cell.key() in about.get("predicted_cached", {}):
                            guess = about["predicted_cached"][cell.key()]
                            cached[cell.key()].append((guess, value))
                    ms = f"{value * 1e3:.2f} ms" if isinstance(value, float) else ""
                    shown = value.splitlines()[-1] if isinstance(value, str) else ms
                    _say(f"round {r + 1}, {i + 1}/{len(order)}: {cell.key()}: {shown}")
    rows = [_row(cell, rounds[cell.key()], failed.get(cell.key()), cached[cell.key()])
            for group in cells.values() for cell in group]  # fmt: skip
    meta = {
        **common.machine_meta(),
        "wall_s": time.perf_counter() - started,
        "mode": "validation (predicted before the run)",
        "calibration": f"{calibration.host}, measured {calibration.measured_at[:16]} UTC",
        "profiles": profiles,
        "config": {
            "configs": list(cfg.config),
            "worlds": list(cfg.worlds),
            "strategies": list(cfg.strategies),
            "compress": list(cfg.compress),
            "train_steps": cfg.train_steps,
            "rounds": cfg.rounds,
            "cached_slowdown": cfg.cached_slowdown,
        },  # fmt: skip
    }
    result = {"meta": meta, "rows": rows, "halves": summarize(rows)}
    if cfg.rounds > 1:
        result["repeatability"] = repeatability(rows)
    if cfg.cached_slowdown:  # the diagnostic, beside (never instead of) the figures above
        result["cached_halves"] = summarize(rows, "cached_error")
    return result


def _row(
    cell: Cell,
    rounds: list[tuple[float, float]],
    failure: str | None,
    cached: list[tuple[float, float]] | None = None,
) -> dict[str, Any]:
    """One cell's report. Its error is the median over rounds of each round's predicted /
    measured - 1: a prediction is compared with the runs made right after it. ``cached``:
    the same with the cached calibration's slow-down (the diagnostic: ``cached_error``)."""
    row: dict[str, Any] = {
        "config": cell.config,
        "family": Path(cell.config).stem,
        "half": half_of(cell.config),
        "world": cell.world,
        "strategy": cell.strategy,
        "compress": cell.compress,
        "predicted_rounds_s": [p for p, _ in rounds],
        "measured_rounds_s": [m for _, m in rounds],
    }
    if rounds:
        row["predicted_s"] = statistics.median(row["predicted_rounds_s"])
        row["measured_s"] = statistics.median(row["measured_rounds_s"])
        row["error"] = statistics.median(p / m - 1.0 for p, m in rounds)
        if len(rounds) > 1:  # the measurement's own noise between rounds (repeatability)
            measured = row["measured_rounds_s"]
            row["repeat_spread"] = max(measured) / min(measured) - 1.0
        if cached:
            row["predicted_cached_rounds_s"] = [p for p, _ in cached]
            row["cached_error"] = statistics.median(p / m - 1.0 for p, m in cached)
    else:
        row["skipped"] = failure.splitlines()[-1] if failure else "the plan skipped this setup"
    if failure:  # in some round: the run's last lines, for the cause
        row["failure_log"] = failure
    return row


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # progress: the report itself goes to stdout


def summarize(rows: list[dict[str, Any]], key: str = "error") -> dict[str, dict[str, Any]]:
    """Per half: cells, median and worst absolute error (``key`` of each row), cells within
    10%, and per world."""
    out = {}
    for half in sorted({r["half"] for r in rows}):
        mine = [r for r in rows if r["half"] == half and key in r]
        out[half] = _stats(mine, key)
        out[half]["by_world"] = {
            str(w): _stats([r for r in mine if r["world"] == w], key)
            for w in sorted({r["world"] for r in mine})
        }
    return out


def repeatability(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per half: how far the same cell's measured step moved between rounds (``repeat_spread``
    of each row: the slowest round over the fastest, - 1): the cells, the median and the
    worst spread, and the cells that moved more than ``WORST_TARGET``. The same command and
    code, one round apart: the machine's own noise, to read the errors against. A profile
    taken right before a config's cells follows what the machine's speed does over minutes;
    what one run does differently from the next, no prediction made before it can."""
    out = {}
    for half in sorted({r["half"] for r in rows}):
        spreads = [r["repeat_spread"] for r in rows if r["half"] == half and "repeat_spread" in r]
        if spreads:
            out[half] = {
                "cells": len(spreads),
                "median_spread": statistics.median(spreads),
                "worst_spread": max(spreads),
                "over_worst_target": sum(s > WORST_TARGET for s in spreads),
            }
    return out


def _stats(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    errors = [abs(r[key]) for r in rows]
    if not errors:
        return {"cells": 0}
    return {
        "cells": len(errors),
        "median_abs_error": statistics.median(errors),
        "worst_abs_error": max(errors),
        "within_10": sum(e <= 0.10 for e in errors),
        "median_error": statistics.median(r[key] for r in rows),  # the sign: bias
    }


def format_validation(result: dict[str, Any]) -> str:
    lines = [
        f"planner validation: predicted before the run ({result['meta']['calibration']})",
        f"{'half':<11} {'family':<13} {'N':>2} {'strategy':<12} {'compress':<8} "
        f"{'predicted ms':>12} {'measured ms':>11} {'error':>7}",
    ]
    for r in result["rows"]:
        head = (f"{r['half']:<11} {r['family']:<13} {r['world']:>2} {r['strategy']:<12} "
                f"{r['compress']:<8}")  # fmt: skip
        if "error" not in r:
            lines.append(f"{head} skipped: {r['skipped']}")
            continue
        lines.append(
            f"{head} {r['predicted_s'] * 1e3:>12.2f} {r['measured_s'] * 1e3:>11.2f} "
            f"{100 * r['error']:>+6.1f}%"
        )
    lines += [_half_line(half, s) for half, s in result["halves"].items() if s["cells"]]
    for half, s in result.get("repeatability", {}).items():
        lines.append(
            f"{half}: the measurement's own noise, the same cell between rounds (slowest / "
            f"fastest - 1): median {100 * s['median_spread']:.1f}%, worst "
            f"{100 * s['worst_spread']:.1f}%, {s['over_worst_target']} of {s['cells']} cells "
            f"over {100 * WORST_TARGET:.0f}%"
        )
    cached = result.get("cached_halves", {})
    if cached:
        lines.append("diagnostic, not the figures above: with the cached calibration's compute "
                     "slow-down instead of the one probed before each config's cells")  # fmt: skip
        lines += [_half_line(half, s, targets=False) for half, s in cached.items() if s["cells"]]
    return "\n".join(lines)


def _half_line(half: str, s: dict[str, Any], targets: bool = True) -> str:
    worlds = ", ".join(
        f"N={w}: median {100 * x['median_abs_error']:.1f}%" for w, x in s["by_world"].items()
    )
    target = ""
    if half == "held_back" and targets:
        hit = s["median_abs_error"] <= MEDIAN_TARGET and s["worst_abs_error"] <= WORST_TARGET
        target = f" (targets: median <= 10%, worst <= 20%: {'met' if hit else 'MISSED'})"
    return (
        f"{half}: {s['cells']} cells, median |error| {100 * s['median_abs_error']:.1f}%, "
        f"worst {100 * s['worst_abs_error']:.1f}%, {s['within_10']} within 10%, "
        f"median error {100 * s['median_error']:+.1f}% ({worlds}){target}"
    )


def check_validation(result: dict[str, Any]) -> None:
    if not any("error" in r for r in result["rows"]):
        raise ConfigError("bench planner --config: no cell was both predicted and measured")


def validate_paths(paths: tuple[str, ...]) -> None:
    for path in paths:
        if not Path(path).is_file():
            raise ConfigError(f"--config: {path!r} is not a file; give a run config (TOML)")
