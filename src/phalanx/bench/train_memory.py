"""``phalanx bench memory``: the memory manager measured on whole ``phalanx train`` processes, as
a user measures them: none, full recomputation and budgets of the measured unmanaged peak, with
the issue's targets. Method: docs/bench-methods.md, "memory"."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from phalanx import bench as common
from phalanx.config import load_config
from phalanx.errors import ConfigError
from phalanx.fields import option

OVERHEAD_TARGET = 0.24  # at the 50% budget (Layrub: +24.1% step time at -58.2% memory)
MIB = float(2**20)
_MLP_BLOCK = (
    '  { type = "linear", in_features = 256, out_features = 2048 },\n  { type = "gelu" },\n'
    '  { type = "linear", in_features = 2048, out_features = 256 },\n'
    '  { type = "layernorm", normalized_shape = 256 },\n'
)
HELD_OUT = {
    # issue 26's model: embedding, three per-token MLP blocks, a head; seq 256, batch 64, Adam
    "mlp_per_token": (
        '[model]\nlayers = [\n  { type = "embedding", num_embeddings = 97, embedding_dim = 256 '
        "},\n" + _MLP_BLOCK * 3 + '  { type = "linear", in_features = 256, out_features = 97 },\n'
        ']\n[data]\nsource = "text"\nseq_len = 256\nbatch_size = 64\n'
        '[optimizer]\nname = "adam"\nlr = 0.001\n'
    ),
    # configs/gpt_pipeline.toml's model, whole, at batch 128: activations dominate
    "gpt": (
        '[model]\nlayers = [\n  { type = "gpt_embedding", vocab_size = 97, dim = 128, '
        "max_seq_len = 64 },\n"
        + '  { type = "transformer_block", dim = 128, num_heads = 4 },\n'
        * 4
        + '  { type = "layernorm", normalized_shape = 128 },\n'
        '  { type = "linear", in_features = 128, out_features = 97 },\n]\n'
        '[data]\nsource = "text"\nseq_len = 64\nbatch_size = 128\n'
        '[optimizer]\nname = "adamw"\nlr = 0.002\n'
    ),
}


@dataclass(frozen=True, kw_only=True)
class TrainMemoryBenchConfig:
    """Everything one ``phalanx bench memory`` run uses (recorded in the JSON)."""

    configs: tuple[str, ...] = ()  # run configs (TOML); none: the held-out models above
    budgets: tuple[float, ...] = (0.75, 0.5, 0.3)
    rounds: int = option(2, "rounds (every variant once per round)")
    steps: int = option(6, "training steps per process")
    warmup: int = option(2, "of them, not timed (the first allocates the optimizer state)")
    timeout_s: float = option(900.0, "seconds per process")

    def validate(self) -> None:
        if self.rounds < 1 or self.steps < 1 or self.warmup < 0:
            raise ConfigError("--rounds and --steps must be >= 1, --warmup >= 0")
        if self.warmup >= self.steps:
            raise ConfigError(f"--warmup: {self.warmup} leaves no timed step of {self.steps}")
        if not self.budgets or any(not 0 < f < 1 for f in self.budgets):
            raise ConfigError("--budgets: fractions in (0, 1), e.g. 0.75,0.5,0.3")
        if len(set(self.budgets)) != len(self.budgets):
            raise ConfigError("--budgets: a fraction is given twice")
        for path in self.configs:
            if not Path(path).is_file():
                raise ConfigError(f"--configs: {path!r} is not a file")

    def variants(self) -> list[str]:
        return ["none", "recompute", *(f"phalanx@{f:g}" for f in self.budgets)]


# -- one process ----------------------------------------------------------------------------------
def run_train(
    config: Path, run_dir: Path, sets: list[str], cfg: TrainMemoryBenchConfig
) -> dict[str, Any]:
    """One ``phalanx train`` process; its peaks, step times and plan, or {"error": line}."""
    sets = ["train.progress=false", f"train.steps={cfg.steps}", "checkpoint.every=0", *sets]
    command = common.train_command(config, run_dir, sets)
    log = run_dir.parent / f"{run_dir.name}.log"  # (with_suffix would cut "phalanx@0.75")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        status, usage = _wait(proc, cfg.timeout_s)
    text = log.read_text(errors="replace")
    if status != 0:
        return {"error": common.last_line(text, status)}
    summary = json.loads((run_dir / "summary.json").read_text())
    times = common.step_times(run_dir)[cfg.warmup :]
    start = summary["memory_start_mb"]
    found = re.search(r"memory plan: predicted peak ([0-9.]+) MiB", text)
    return {
        "peak_mb": summary["memory_peak_mb"],
        "process_peak_mb": usage.ru_maxrss / 1024 - start,  # ru_maxrss: KiB on Linux
        "start_mb": start,
        "step_s": times,
        "median_step_s": statistics.median(times),
        "predicted_peak_mb": float(found.group(1)) if found else None,
        "budget_mb": summary.get("memory_budget_mb"),
    }


def _wait(proc: subprocess.Popen, timeout_s: float) -> tuple[int, Any]:
    """The child's exit status and resource usage (``wait4``); killed past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage
        if time.monotonic() > deadline:
            proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = -9
            return -9, usage
        time.sleep(0.05)


def _layer_names(config: Path) -> list[str]:
    """The names ``memory.recompute`` takes: the model's top-level layers."""
    from phalanx import build

    return [str(i) for i in range(len(list(build.model(load_config(config)).children())))]


# -- the benchmark --------------------------------------------------------------------------------
def run_benchmark(cfg: TrainMemoryBenchConfig) -> dict[str, Any]:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-memory-") as tmp:
        root = Path(tmp)
        configs = {Path(p).stem: Path(p) for p in cfg.configs}
        if not configs:
            for name, text in HELD_OUT.items():
                (root / f"{name}.toml").write_text(text)
                configs[name] = root / f"{name}.toml"
        models = {name: _measure_model(cfg, path, root / name) for name, path in configs.items()}
    meta = common.machine_meta(config=asdict(cfg), wall_s=time.perf_counter() - started)
    return {"meta": meta, "models": models}


def _measure_model(cfg: TrainMemoryBenchConfig, config: Path, root: Path) -> dict[str, Any]:
    recompute = 'memory.recompute=["' + '", "'.join(_layer_names(config)) + '"]'
    variants = cfg.variants()
    rounds: list[dict[str, Any]] = []
    unmanaged: float | None = None
    for k in range(cfg.rounds):
        order = common.rotate(variants, k)
        if unmanaged is None:  # round 0 measures none first: the budgets are fractions of it
            order = ["none", *(v for v in order if v != "none")]
        runs: dict[str, Any] = {}
        for variant in order:
            sets = []
            if variant == "recompute":
                sets = [recompute]
            elif variant.startswith("phalanx@"):
                assert unmanaged is not None  # none ran first in round 0
                fraction = float(variant.split("@")[1])
                sets = [f"memory.budget_mb={round(fraction * unmanaged, 1)}"]
            runs[variant] = run_train(config, root / f"r{k}-{variant}", sets, cfg)
            if variant == "none" and unmanaged is None:
                if "error" in runs[variant]:
                    raise ConfigError(f"bench memory: {config}: {runs[variant]['error']}")
                unmanaged = runs[variant]["peak_mb"]
        rounds.append({"order": order, "runs": runs})
    assert unmanaged is not None
    return {"config": str(config), "unmanaged_peak_mb": unmanaged, "rounds": rounds,
            "summary": _summarize(variants, rounds)}  # fmt: skip


def _summarize(variants: list[str], rounds: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name in variants:
        runs = [r["runs"][name] for r in rounds]
        failed = [run["error"] for run in runs if "error" in run]
        if failed:
            summary[name] = {"error": failed[0], "failed_rounds": len(failed)}
            continue
        row = {key: statistics.median(run[key] for run in runs)
               for key in ("peak_mb", "process_peak_mb", "median_step_s")}  # fmt: skip
        row["budget_mb"] = runs[0]["budget_mb"]
        row["predicted_peak_mb"] = runs[0]["predicted_peak_mb"]
        for base in ("none", "recompute"):
            pairs = [(r["runs"][name], r["runs"][base]) for r in rounds]
            if all("error" not in b for _, b in pairs):
                row[f"time_vs_{base}"] = statistics.median(
                    a["median_step_s"] / b["median_step_s"] for a, b in pairs
                )
                row[f"peak_vs_{base}"] = statistics.median(
                    a["peak_mb"] / b["peak_mb"] for a, b in pairs
                )
        summary[name] = row
    return summary


# -- checks and the report ------------------------------------------------------------------------
def targets(model: dict[str, Any]) -> list[str]:
    """PASS / MISS lines of one model."""
    summary, lines = model["summary"], []
    half = summary.get("phalanx@0.5")
    if half is None:
        lines.append("n/a   step time at the 50% budget: 0.5 is not among --budgets")
    elif "error" in half:
        lines.append(f"MISS  step time at the 50% budget: not run: {half['error']}")
    else:
        ratio, limit = half["time_vs_none"], 1 + OVERHEAD_TARGET
        word = "PASS" if ratio <= limit else "MISS"
        lines.append(
            f"{word}  step time at the 50% budget: {ratio:.2f}x none (target <= {limit:.2f}x)"
        )
    recompute = summary.get("recompute", {})
    for name, row in summary.items():
        if not name.startswith("phalanx@") or "error" in row:
            continue
        within = row["peak_mb"] <= row["budget_mb"]
        lines.append(f"{'PASS' if within else 'MISS'}  {name}: measured peak "
                     f"{row['peak_mb']:.0f} MiB, budget {row['budget_mb']:.0f} MiB")  # fmt: skip
        if "error" in recompute or "time_vs_recompute" not in row:
            continue
        lower_peak = row["peak_mb"] <= recompute["peak_mb"]
        ok = not lower_peak or row["time_vs_recompute"] <= 1.0
        lines.append(f"{'PASS' if ok else 'MISS'}  {name} vs full recomputation: "
                     f"{row['time_vs_recompute']:.2f}x its time at {row['peak_mb']:.0f} vs "
                     f"{recompute['peak_mb']:.0f} MiB")  # fmt: skip
    return lines


def check(result: dict[str, Any]) -> None:
    """Every measured number is finite and positive (no timing assertions)."""
    for name, model in result["models"].items():
        for variant, row in model["summary"].items():
            if "error" in row:
                continue
            for key in ("peak_mb", "median_step_s"):
                if not row[key] > 0:
                    raise RuntimeError(f"bench memory: {name} {variant}: {key} = {row[key]}")


def format_report(result: dict[str, Any]) -> str:
    lines = []
    for name, model in result["models"].items():
        lines.append(f"{name} ({model['config']}): unmanaged peak {model['unmanaged_peak_mb']:.0f} "
                     "MiB above the start (round 0)")  # fmt: skip
        lines.append(
            f"{'variant':<14} {'peak MiB':>9} {'/usr/bin/time':>13} {'predicted':>9} "
            f"{'step s':>7} {'time/none':>9} {'peak/none':>9} {'time/recomp':>11}"
        )
        for variant, row in model["summary"].items():
            if "error" in row:
                lines.append(f"{variant:<14} not run: {row['error']}")
                continue
            predicted = row["predicted_peak_mb"] if row.get("budget_mb") else None
            lines.append(
                f"{variant:<14} {row['peak_mb']:>9.1f} {row['process_peak_mb']:>13.1f} "
                f"{'' if predicted is None else f'{predicted:.1f}':>9} "
                f"{row['median_step_s']:>7.3f} {row.get('time_vs_none', 0):>9.2f} "
                f"{row.get('peak_vs_none', 0):>9.2f} {row.get('time_vs_recompute', 0):>11.2f}"
            )
        lines.append(
            "save_on_cpu    not run: on a CPU device the host is the device (it moves nothing)"
        )
        lines += targets(model)
        lines.append("")
    return "\n".join(lines)


common.register("memory",
                "phalanx train processes: budgets vs none and full recomputation",
                TrainMemoryBenchConfig, run_benchmark, check, format_report)  # fmt: skip
