"""``phalanx bench compile``: ``[train] compile`` off and on, measured on whole ``phalanx train``
processes of one run config, as a user runs them. Method: docs/bench-methods.md, "compile"."""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from phalanx import bench as common
from phalanx.errors import ConfigError
from phalanx.fields import option

VARIANTS = ("off", "on")


@dataclass(frozen=True, kw_only=True)
class CompileBenchConfig:
    """One ``phalanx bench compile`` run (recorded in the JSON)."""

    nproc: int = option(2, "processes per run (the GPT config: its 2 pipeline stages)")
    sets: tuple[str, ...] = option((), "more --set items for both variants (SECTION.KEY=VALUE)")
    rounds: int = option(2, "rounds (both variants once per round, the order alternating)")
    steps: int = option(40, "training steps per process")
    config: str = option("configs/gpt_pipeline.toml", "run config (TOML), trained off and on")
    warmup: int = option(5, "of them, not timed (the first compiles)")
    timeout_s: float = option(900.0, "seconds per process")

    def validate(self) -> None:
        if self.rounds < 1 or self.steps < 1 or self.nproc < 1 or self.warmup < 0:
            raise ConfigError("--rounds, --steps and --nproc must be >= 1, --warmup >= 0")
        if self.warmup >= self.steps:
            raise ConfigError(f"--warmup: {self.warmup} leaves no timed step of {self.steps}")
        if not Path(self.config).is_file():
            raise ConfigError(f"--config: {self.config!r} is not a file")


def run_train(cfg: CompileBenchConfig, compiled: bool, run_dir: Path) -> dict[str, Any]:
    """One ``phalanx train`` process; its step times and compile time, or {"error": line}."""
    sets = ["train.progress=false", f"train.steps={cfg.steps}", "checkpoint.every=0",
            "train.val_every=0", *cfg.sets, f"train.compile={str(compiled).lower()}"]  # fmt: skip
    command = [*common.train_command(cfg.config, run_dir, sets), "--nproc", str(cfg.nproc)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=cfg.timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {cfg.timeout_s:.0f} s"}
    if proc.returncode != 0:
        return {"error": common.last_line(proc.stdout + proc.stderr, proc.returncode)}
    summary = json.loads((run_dir / "summary.json").read_text())
    every = common.step_times(run_dir)
    times = every[cfg.warmup :]
    return {
        "step_s": times,
        "median_step_s": statistics.median(times),
        "first_step_s": every[0],
        "compile_s": summary.get("compile_s"),
        "val_loss": summary.get("val_loss"),
        "compile_line": next((x for x in proc.stdout.splitlines() if x.startswith("compile:")), ""),
    }


def run_benchmark(cfg: CompileBenchConfig) -> dict[str, Any]:
    started = time.perf_counter()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-compile-") as tmp:
        for r in range(cfg.rounds):
            order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
            measured = {v: run_train(cfg, v == "on", Path(tmp) / f"{r}-{v}") for v in order}
            rounds.append({"order": order, "variants": measured})
    meta = common.machine_meta(wall_s=time.perf_counter() - started, config=asdict(cfg))
    return {"meta": meta, "rounds": rounds, "summary": summarize(rounds)}


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    failed = [
        f"round {i} {v}: {m['error']}"
        for i, r in enumerate(rounds)
        for v, m in r["variants"].items()
        if "error" in m
    ]
    if failed:
        return {"failed": failed}

    def median(variant: str, key: str) -> float:
        return statistics.median(r["variants"][variant][key] for r in rounds)

    off, on = median("off", "median_step_s"), median("on", "median_step_s")
    compile_s = median("on", "compile_s")
    saved = off - on
    return {
        "median_step_s": {"off": off, "on": on},
        "first_step_s": {v: median(v, "first_step_s") for v in VARIANTS},
        "speedup": statistics.median(
            r["variants"]["off"]["median_step_s"] / r["variants"]["on"]["median_step_s"]
            for r in rounds
        ),
        "compile_s": compile_s,
        "break_even_steps": compile_s / saved if saved > 0 else None,
        "val_loss": {v: median(v, "val_loss") for v in VARIANTS},
    }


def format_report(result: dict[str, Any]) -> str:
    s = result["summary"]
    cfg = result["meta"]["config"]
    lines = [f"{cfg['config']} on {cfg['nproc']} process(es), {cfg['steps']} steps"]
    lines.append(f"{'compile':<8} {'step ms':>8} {'first step s':>13} {'val loss':>9}")
    for v in VARIANTS:
        lines.append(
            f"{v:<8} {1e3 * s['median_step_s'][v]:>8.1f} {s['first_step_s'][v]:>13.1f} "
            f"{s['val_loss'][v]:>9.4f}"
        )
    even = s["break_even_steps"]
    lines.append(
        f"compiled steps {s['speedup']:.2f}x the eager ones' speed (median of per-round "
        f"ratios); compile {s['compile_s']:.1f} s, "
        + (f"repaid after {even:.0f} steps" if even is not None else "never repaid here")
    )
    return "\n".join(lines)


def check(result: dict[str, Any]) -> None:
    failed = result["summary"].get("failed")
    if failed:
        raise ConfigError(f"bench compile: a run failed: {failed[0]}")


common.register("compile",
                "[train] compile off vs on: phalanx train processes of the GPT config",
                CompileBenchConfig, run_benchmark, check, format_report)  # fmt: skip
