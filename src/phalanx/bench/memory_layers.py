"""``phalanx bench memory-layers``: phalanx's memory manager against torch's own tools
(``torch.utils.checkpoint``, ``save_on_cpu``) on a conv net whose saved activations dominate the
peak; each measurement a fresh process. Method, variants and targets: docs/bench-methods.md,
"memory-layers"."""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import os
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from phalanx import bench as common
from phalanx.errors import ConfigError
from phalanx.fields import option
from phalanx.memory import measure
from phalanx.memory.manager import MemoryConfig, MemoryManager
from phalanx.memory.tiers import TierConfig
from phalanx.runtime.context import RuntimeConfig

LR, MOMENTUM, CLASSES = 0.01, 0.9, 10
BASELINES = ("none", "checkpoint", "save_on_cpu")
UNBOUNDED_MB = 2.0**40  # a budget every plan fits: the plan keeps every layer, U is its peak
OVERHEAD_TARGET = 0.24  # at the 50% budget (Layrub: +24.1% step time at -58.2% memory)
DEVICES = ("cpu", "cuda")
LOSS_RTOL = 1e-5  # CUDA: losses agree within this relative difference (kernels' summation order)
PEAK_OF = {  # what a run's peak_bytes is, per device type (recorded in the JSON)
    "cpu": "rss: the process's VmHWM over the peak steps above its VmRSS before them",
    "cuda": "device: torch.cuda.max_memory_allocated over the peak steps above "
    "torch.cuda.memory_allocated before them",
}


@dataclass(frozen=True, kw_only=True)
class MemoryBenchConfig:
    """Everything one ``phalanx bench memory-layers`` run uses (recorded in the JSON)."""

    batch_size: int = option(96, "images per step")
    channels: int = option(16, "channels of the blocks")
    budgets: tuple[float, ...] = (0.75, 0.5, 0.3)  # --budgets (budgets_from_flags)
    image_size: int = option(32, "image side")
    blocks: int = option(8, "residual blocks")
    rounds: int = option(3, "rounds")
    steps: int = option(3, "timed steps per variant")
    spill_dir: str = option("", "spill file directory (default: the temp directory)")
    warmup: int = option(2, "untimed steps first (the first grows the reused heap)")
    peak_steps: int = option(1, "steps the peak covers")
    seed: int = option(0, "weight and data seed")
    threads: int = option(1, "intra-op threads per process")
    device: str = option("cpu", "where the model trains and the peak is measured: cpu or cuda")
    fresh_processes: bool = True  # False: every variant in this process (tests; peaks rougher)
    timeout_s: float = option(600.0, "seconds per measuring process")

    def validate(self) -> None:
        numbers = ("batch_size", "channels", "image_size", "blocks", "rounds", "steps")
        common.at_least(self, 1, *numbers, "peak_steps")
        common.at_least(self, 0, "warmup", "threads")
        if not self.budgets:
            raise ConfigError("--budgets: give at least one fraction, e.g. 0.75,0.5,0.3")
        for fraction in self.budgets:
            if not 0 < fraction < 1:
                raise ConfigError(f"--budgets: {fraction} is not a fraction in (0, 1)")
        if len(set(self.budgets)) != len(self.budgets):
            raise ConfigError("--budgets: a fraction is given twice")
        if self.spill_dir and not os.path.isdir(self.spill_dir):
            raise ConfigError(f"--spill-dir: {self.spill_dir!r} is not a directory")
        check_device(self.device)

    def variants(self) -> list[str]:
        return [*BASELINES, *(phalanx_name(f) for f in self.budgets), SMALLEST]


SMALLEST = "phalanx@min"  # phalanx's smallest plan: what a budget below the planner's floor gets


def phalanx_name(fraction: float) -> str:
    return f"phalanx@{fraction:g}"


def check_device(device: str) -> None:
    """``--device``: ``cpu``, or ``cuda`` where torch sees a GPU; else one line naming the fix."""
    if device not in DEVICES:
        raise ConfigError(f"--device: {device!r} is not one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise ConfigError(
            f"--device cuda: torch {torch.__version__} ({build}) sees no CUDA device here; "
            "run on a machine with a GPU, or use --device cpu"
        )


# -- the model ----------------------------------------------------------------------------------
class PreActBlock(nn.Module):
    """x + conv(relu(bn(conv(relu(bn(x)))))): saves four tensors of x's size."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.relu(self.bn1(x)))
        return x + self.conv2(F.relu(self.bn2(h)))


def build_layers(cfg: MemoryBenchConfig) -> list[nn.Module]:
    """The benchmark's layers (an nn.Sequential's children), identical in every process."""
    torch.manual_seed(cfg.seed)
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cfg.channels, CLASSES))
    return [
        nn.Conv2d(3, cfg.channels, 3, padding=1),
        *[PreActBlock(cfg.channels) for _ in range(cfg.blocks)],
        head,
    ]


def make_batch(
    cfg: MemoryBenchConfig, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch, drawn on the host (the same numbers for every device), then on ``device``."""
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    size = (cfg.batch_size, 3, cfg.image_size, cfg.image_size)
    x = torch.randn(size, generator=generator)
    y = torch.randint(0, CLASSES, (cfg.batch_size,), generator=generator)
    if device is None or device.type == "cpu":
        return x, y
    return x.to(device), y.to(device)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


class _Checkpointed(nn.Module):
    """torch.utils.checkpoint around one layer: only its input is saved, backward reruns it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=False)


# -- one measurement (a fresh process, or this one) ---------------------------------------------
def measure_variant(
    cfg: MemoryBenchConfig, variant: str, budget_mb: float = 0.0, probe: bool = False
) -> dict[str, Any]:
    """Build ``variant`` on ``cfg.device``, measure its step peak, then time it
    (docs/bench-methods.md). ``probe``: also plan with an unbounded budget and return the
    planner's unmanaged peak. A budget the planner cannot meet returns {"variant", "error"}."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    cpu = device.type == "cpu"
    allocator = _Allocator(enabled=cpu)  # glibc's modes: host memory only
    allocator.measuring()  # fresh processes start so (the environment): here for in-process runs
    x, y = make_batch(cfg, device)
    _warm_up(cfg, x, y)
    layers = [layer.to(device) for layer in build_layers(cfg)]
    manager: MemoryManager | None = None
    around: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    if variant == "checkpoint":
        layers = [_Checkpointed(layer) for layer in layers]
    elif variant == "save_on_cpu":
        around = functools.partial(_save_on_cpu, pin_memory=not cpu)
    elif variant.startswith("phalanx@"):
        memory = MemoryConfig(
            budget_mb=budget_mb,
            tier=TierConfig(directory=cfg.spill_dir),
            release_host_memory=cpu,  # glibc's settings: for host memory, the CPU path's only
        )
        try:
            manager = MemoryManager.build(layers, memory, device, (x, y), _loss, _sgd)
        except ConfigError as e:  # the budget is below the planner's floor: a result, reported
            return {"variant": variant, "error": str(e)}
        around = manager.step
    elif variant != "none":
        raise ConfigError(f"bench memory: unknown variant {variant!r}")
    model = nn.Sequential(*layers).train()
    optimizer = _sgd(list(model.parameters()))
    losses: list[float] = []

    def step() -> None:
        with around():
            loss = _loss(model(x), y)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))

    def timed_step() -> float:
        common.synchronize(device)
        start = time.perf_counter()
        step()
        common.synchronize(device)  # a GPU's step is done when its queued kernels are
        return time.perf_counter() - start

    # Phase 1: the peak, every large block its own mapping (freed to the kernel at once).
    allocator.measuring()
    step()  # the first step allocates the optimizer state, which stays
    gc.collect()
    allocator.trim()
    meter = measure.StepPeak(device)  # what is held now; the high-water mark reset
    peak_times = [timed_step() for _ in range(cfg.peak_steps)]
    peak = meter.peak_bytes()
    high = measure.peak_bytes(device)
    # Phase 2: the time, freed blocks kept in the heap for reuse (no page faults once warm).
    allocator.reuse()
    for _ in range(cfg.warmup):
        step()
    times, faults, spill = [], [], []
    for _ in range(cfg.steps):
        faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        times.append(timed_step())
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
        if manager is not None and manager.offloader is not None:
            spill.append(manager.offloader.stats.as_dict())
    held = "rss" if cpu else "device"
    out: dict[str, Any] = {
        "variant": variant,
        "device": cfg.device,
        "step_s": times,
        "median_step_s": statistics.median(times),
        "minor_faults": faults,
        "peak_phase_step_s": peak_times,
        f"baseline_{held}_bytes": meter.start_bytes,
        f"peak_{held}_bytes": high,
        "peak_bytes": peak,
        "peak_of": PEAK_OF[device.type],
        "peak_reset": meter.exact,
        "allocator_control": allocator.available,
        "cgroup_peak_bytes": measure.cgroup_peak_bytes(),
        "losses": losses,
        "pid": os.getpid(),
    }
    if manager is not None:
        plan = manager.plan
        out["plan"] = {
            "budget_bytes": plan.budget,
            "predicted_peak_bytes": plan.predicted_peak,
            "unmanaged_peak_bytes": plan.unmanaged_peak,
            "predicted_overhead_s": plan.predicted_overhead_s,
            "choices": plan.choices,
            "describe": manager.describe(),
        }
        out["spill"] = spill
        manager.close()
    if probe:
        del model, optimizer, layers
        gc.collect()
        fresh = [layer.to(device) for layer in build_layers(cfg)]
        unbounded = MemoryConfig(budget_mb=UNBOUNDED_MB, release_host_memory=cpu)
        planner = MemoryManager.build(fresh, unbounded, device, (x, y), _loss, _sgd)
        out["unmanaged_predicted_bytes"] = planner.plan.unmanaged_peak
        out["smallest_predicted_bytes"] = planner.plan.smallest_peak
        planner.close()
    return out


def _warm_up(cfg: MemoryBenchConfig, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of a throwaway copy: every variant then starts with what a step loads into the
    process (imports, kernel caches), so the plans' own growth matches the probe's."""
    model = nn.Sequential(*build_layers(cfg)).to(x.device)
    optimizer = _sgd(list(model.parameters()))
    _loss(model(x[:2]), y[:2]).backward()
    optimizer.step()
    del model, optimizer
    gc.collect()


def _save_on_cpu(pin_memory: bool = False) -> contextlib.AbstractContextManager[Any]:
    """torch's offload of saved tensors to host memory (pinned: asynchronous copies off a GPU)."""
    return torch.autograd.graph.save_on_cpu(pin_memory=pin_memory)


def fixed_bytes(cfg: MemoryBenchConfig) -> int:
    """Parameters + gradients + SGD momentum + buffers: the model state in the planner's peak."""
    layers = build_layers(cfg)
    params = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
    buffers = sum(b.numel() * b.element_size() for layer in layers for b in layer.buffers())
    return 3 * params + buffers


# -- in the caller ------------------------------------------------------------------------------
class _Allocator:
    """glibc's malloc switched between two modes at run time (``mallopt``; elsewhere a no-op).

    ``measuring``: blocks from 64 KiB up are their own mappings, so a freed tensor leaves the RSS
    at once and the high-water mark shows a step's true peak. ``reuse``: freed memory stays in
    the heap, never trimmed, so a warm step faults no new page (as a caching allocator): glibc's
    default re-faults tens of thousands of pages a step, which would time the kernel instead.
    ``enabled=False`` (a run on a GPU): every method is a no-op."""

    REUSE_MMAP, REUSE_TRIM, MEASURING_TRIM = measure.REUSE_MMAP_THRESHOLD, 2**31 - 1, 128 << 10

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.available = enabled and measure.malloc_settable()

    def reuse(self) -> None:
        self._set(self.REUSE_MMAP, self.REUSE_TRIM)

    def measuring(self) -> None:
        self._set(measure.MMAP_THRESHOLD, self.MEASURING_TRIM)

    def trim(self) -> None:
        if self.enabled:
            measure.trim()

    def _set(self, mmap_threshold: int, trim_threshold: int) -> None:
        if self.enabled:
            measure.set_malloc(mmap_threshold, trim_threshold)


@contextlib.contextmanager
def _allocator_env(enabled: bool = True) -> Iterator[None]:
    """``allocator_env()`` in os.environ while processes are spawned: glibc reads it at start-up
    (``run_ranks(env=...)`` is too late). ``enabled=False`` (a GPU run): left as it is."""
    if not enabled:
        yield
        return
    saved = {key: os.environ.get(key) for key in measure.allocator_env()}
    os.environ.update(measure.allocator_env())
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def in_fresh_process(measure: Callable[..., Any], cfg: Any, *args: Any) -> Any:
    """``measure(cfg, *args)`` in a fresh process of one rank (``cfg.threads`` intra-op threads,
    ``cfg.timeout_s``), started under ``allocator_env()`` where the peak is host memory."""
    from phalanx.runtime.spawn import run_ranks

    runtime = RuntimeConfig(threads=cfg.threads, timeout_s=cfg.timeout_s)
    with _allocator_env(enabled=cfg.device == "cpu"):
        return run_ranks(_call, 1, measure, cfg, *args, timeout=cfg.timeout_s, runtime=runtime)[0]


def _call(ctx: Any, measure: Callable[..., Any], *args: Any) -> Any:
    return measure(*args)


def _run_one(cfg: MemoryBenchConfig, variant: str, budget_mb: float, probe: bool) -> Any:
    if cfg.fresh_processes:
        return in_fresh_process(measure_variant, cfg, variant, budget_mb, probe)
    threads = torch.get_num_threads()
    try:
        return measure_variant(cfg, variant, budget_mb, probe)
    finally:
        torch.set_num_threads(threads)


def run_benchmark(cfg: MemoryBenchConfig) -> dict[str, Any]:
    """Every round runs every variant once, in an order rotated per round; every number."""
    started = time.perf_counter()
    variants = cfg.variants()
    budgets: dict[str, float] = {}
    unmanaged_predicted = 0
    rounds: list[dict[str, Any]] = []
    for r in range(cfg.rounds):
        measured: dict[str, Any] = {}
        order = common.rotate(variants, r)  # round 0 starts with none: it computes the budgets
        for name in order:
            probe = r == 0 and name == "none"
            result = _run_one(cfg, name, budgets.get(name, 0.0), probe)
            if probe:
                unmanaged_predicted = result["unmanaged_predicted_bytes"]
                for fraction in cfg.budgets:
                    budgets[phalanx_name(fraction)] = fraction * unmanaged_predicted / 2**20
                # the smallest plan's peak, a KiB over for the MiB round trip
                budgets[SMALLEST] = (result["smallest_predicted_bytes"] + 1024) / 2**20
            measured[name] = result
        rounds.append({"order": order, "variants": measured})
    meta = common.machine_meta(
        wall_s=time.perf_counter() - started,
        config=asdict(cfg),
        model=f"pre-activation conv net: {cfg.blocks} blocks x {cfg.channels} channels at "
        f"{cfg.image_size}x{cfg.image_size}, batch {cfg.batch_size}",
        params=sum(p.numel() for layer in build_layers(cfg) for p in layer.parameters()),
        fixed_bytes=fixed_bytes(cfg),
        unmanaged_predicted_bytes=unmanaged_predicted,
        budgets_mb=budgets,
        peak_of=PEAK_OF[cfg.device],
    )
    return summarize({"meta": meta, "rounds": rounds}, cfg)


def summarize(result: dict[str, Any], cfg: MemoryBenchConfig) -> dict[str, Any]:
    """Per variant: medians over rounds and of per-round ratios to none and checkpoint; targets."""
    rounds = result["rounds"]
    summary: dict[str, Any] = {}
    for name in cfg.variants():
        runs = [r["variants"][name] for r in rounds]
        failed = [run["error"] for run in runs if "error" in run]
        if failed:
            summary[name] = {"error": failed[0], "failed_rounds": len(failed)}
            continue
        row: dict[str, Any] = {
            "step_s": [run["median_step_s"] for run in runs],
            "peak_bytes": [run["peak_bytes"] for run in runs],
        }
        pairs = [
            (a, b)
            for r in rounds
            for a, b in zip(r["variants"][name]["losses"], r["variants"]["none"]["losses"])
        ]
        row["max_loss_diff_vs_none"] = max(abs(a - b) for a, b in pairs)
        row["max_loss_rel_diff_vs_none"] = max(relative_diff(a, b) for a, b in pairs)
        row["median_minor_faults"] = statistics.median(
            f for run in runs for f in run["minor_faults"]
        )
        row["median_step_s"] = statistics.median(row["step_s"])
        row["median_peak_bytes"] = statistics.median(row["peak_bytes"])
        row["time_vs_none_rounds"] = _ratios(
            runs, [r["variants"]["none"] for r in rounds], "median_step_s"
        )
        for base in ("none", "checkpoint"):
            base_runs = [r["variants"][base] for r in rounds]
            row[f"time_vs_{base}"] = _median_ratio(runs, base_runs, "median_step_s")
            row[f"peak_vs_{base}"] = _median_ratio(runs, base_runs, "peak_bytes")
        if name.startswith("phalanx@"):
            plans = [run["plan"] for run in runs]
            row["budget_bytes"] = plans[0]["budget_bytes"]
            row["predicted_peak_bytes"] = statistics.median(
                p["predicted_peak_bytes"] for p in plans
            )
            row["choices"] = [_count_choices(p["choices"]) for p in plans]
            spill = [s for run in runs for s in run["spill"]]
            for key in ("bytes_written", "bytes_read", "backward_wait_s", "forward_wait_s"):
                row[f"spill_{key}"] = statistics.median(s[key] for s in spill) if spill else 0
        summary[name] = row
    result["summary"] = summary
    result["meta"]["same_losses"] = all(
        row.get("max_loss_diff_vs_none", 0.0) == 0.0 for row in summary.values()
    )
    result["meta"]["losses_agree"] = all(
        row.get("max_loss_rel_diff_vs_none", 0.0) <= LOSS_RTOL for row in summary.values()
    )
    result["targets"] = _targets(summary, cfg)
    return result


def relative_diff(a: float, b: float) -> float:
    """|a - b| relative to |b| (plain where b is 0; inf where either is NaN or one infinite)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if a == b else math.inf
    return abs(a - b) / abs(b) if b else abs(a - b)


def _ratios(runs: list[dict], bases: list[dict], key: str) -> list[float]:
    return [run[key] / base[key] for run, base in zip(runs, bases) if base[key] > 0]


def _median_ratio(runs: list[dict], bases: list[dict], key: str) -> float | None:
    ratios = _ratios(runs, bases, key)
    return statistics.median(ratios) if ratios else None


def _count_choices(choices: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for choice in choices.values():
        counts[choice] = counts.get(choice, 0) + 1
    return counts


def _targets(summary: dict[str, Any], cfg: MemoryBenchConfig) -> list[dict[str, Any]]:
    """The issue's two targets as PASS/MISS lines with their numbers."""
    out: list[dict[str, Any]] = []
    half = summary.get(phalanx_name(0.5))
    if half is None:
        out.append({
            "target": "overhead at 50%", "pass": None,
            "line": "n/a   overhead at the 50% budget: 0.5 is not among --budgets",
        })  # fmt: skip
    elif "error" in half:
        out.append({
            "target": "overhead at 50%", "pass": False,
            "line": f"MISS  step time at the 50% budget: not run: {half['error']}",
        })  # fmt: skip
    else:
        overhead = half["time_vs_none"] - 1
        ok = overhead <= OVERHEAD_TARGET
        out.append({
            "target": "overhead at 50%", "pass": ok, "overhead": overhead,
            "line": (
                f"{'PASS' if ok else 'MISS'}  step time at the 50% budget: {overhead:+.1%} vs "
                f"none (target <= +{OVERHEAD_TARGET:.0%}; Layrub +24.1% at -58.2%), peak "
                f"{_change(half['peak_vs_none'])}"
            ),
        })  # fmt: skip
    ckpt, smallest = summary["checkpoint"], summary.get(SMALLEST, {})
    for fraction in cfg.budgets:
        row = summary[phalanx_name(fraction)]
        if "error" in row:
            line = f"MISS  budget {fraction:.0%}: not run: {row['error']}"
            if "error" not in smallest and "median_step_s" in smallest:
                line += (
                    f"; phalanx's smallest plan: {1e3 * smallest['median_step_s']:.0f} ms vs "
                    f"full recomputation {1e3 * ckpt['median_step_s']:.0f} ms "
                    f"({smallest['time_vs_checkpoint']:.2f}x), peak "
                    f"{_mib(smallest['median_peak_bytes']):.0f} vs "
                    f"{_mib(ckpt['median_peak_bytes']):.0f} MiB"
                )
            out.append({
                "target": f"no slower than recomputation at {fraction:g}", "pass": False,
                "line": line,
            })  # fmt: skip
            continue
        ratio, peak = row["time_vs_checkpoint"], row["peak_vs_checkpoint"]
        ok = ratio <= 1.0
        where = (
            "at a HIGHER peak" if peak is not None and peak > 1.0 else "at a lower or equal peak"
        )
        out.append({
            "target": f"no slower than recomputation at {fraction:g}", "pass": ok,
            "time_vs_checkpoint": ratio, "peak_vs_checkpoint": peak,
            "line": (
                f"{'PASS' if ok else 'MISS'}  budget {fraction:.0%}: phalanx "
                f"{1e3 * row['median_step_s']:.0f} ms vs full recomputation "
                f"{1e3 * ckpt['median_step_s']:.0f} ms ({ratio:.2f}x), peak "
                f"{_mib(row['median_peak_bytes']):.0f} vs {_mib(ckpt['median_peak_bytes']):.0f} "
                f"MiB ({_times(peak)}, {where})"
            ),
        })  # fmt: skip
    return out


def _mib(nbytes: float) -> float:
    return nbytes / 2**20


def _change(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio - 1:+.1%}"


def _spread(ratios: list[float]) -> str:
    return f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def format_report(result: dict[str, Any]) -> str:
    meta, summary = result["meta"], result["summary"]
    cfg = meta["config"]
    where = "one fresh process per measurement" if cfg["fresh_processes"] else "in this process"
    if cfg.get("device", "cpu") == "cuda":
        where += ", on the GPU"
    lines = [
        f"{meta['model']}; {meta['params']:,} parameters; {cfg['rounds']} round(s) x "
        f"{cfg['steps']} timed step(s) after {cfg['warmup']} warm-up, {where}",
        f"planner: unmanaged peak {_mib(meta['unmanaged_predicted_bytes']):.1f} MiB predicted "
        f"(parameters + gradients + optimizer {_mib(meta['fixed_bytes']):.2f} MiB)",
        f"{'variant':<14} {'step ms':>8} {'vs none':>8} {'rounds':>11} {'peak MiB':>9} "
        f"{'vs none':>8} {'budget':>7} {'predicted':>9} {'spill w/r MiB':>14}  plan",
    ]
    for name, row in summary.items():
        if "error" in row:
            lines.append(f"{name:<14} not run: {row['error']}")
            continue
        budget = predicted = spill = plan = ""
        if "budget_bytes" in row:
            budget = f"{_mib(row['budget_bytes']):.0f}"
            predicted = f"{_mib(row['predicted_peak_bytes']):.0f}"
            spill = f"{_mib(row['spill_bytes_written']):.0f}/{_mib(row['spill_bytes_read']):.0f}"
            plan = ", ".join(f"{n} {c}" for c, n in sorted(row["choices"][0].items()))
        lines.append(
            f"{name:<14} {1e3 * row['median_step_s']:>8.1f} {_times(row['time_vs_none']):>8} "
            f"{_spread(row['time_vs_none_rounds']):>11} "
            f"{_mib(row['median_peak_bytes']):>9.1f} {_times(row['peak_vs_none']):>8} "
            f"{budget:>7} {predicted:>9} {spill:>14}  {plan}"
        )
    if cfg.get("device", "cpu") == "cuda":
        lines.append(
            "peak: CUDA max_memory_allocated - memory_allocated before the peak step (what a step "
            "adds above what the GPU holds between steps); vs none: median of per-round ratios, "
            "rounds: their range; spill: per step (pinned host memory)"
        )
    else:
        lines.append(
            "peak: VmHWM - RSS before the peak step (what a step adds above what the process "
            "holds between steps); vs none: median of per-round ratios, rounds: their range; "
            "spill: per step"
        )
    faults = ", ".join(
        f"{name} {row['median_minor_faults']:.0f}"
        for name, row in summary.items()
        if "error" not in row
    )
    lines.append(f"minor page faults per timed step (median): {faults}")
    for name, row in summary.items():
        if "budget_bytes" in row and row["median_peak_bytes"] > row["budget_bytes"]:
            lines.append(
                f"note: {name} measured {_mib(row['median_peak_bytes']):.0f} MiB, above its "
                f"budget of {_mib(row['budget_bytes']):.0f} MiB (predicted "
                f"{_mib(row['predicted_peak_bytes']):.0f} MiB)"
            )
    if not meta["same_losses"]:
        worst = max(row.get("max_loss_rel_diff_vs_none", 0.0) for row in summary.values())
        if meta.get("losses_agree") and cfg.get("device", "cpu") == "cuda":
            lines.append(
                f"note: the variants' losses differ from none's by at most {worst:.1e} relative "
                f"(within {LOSS_RTOL:g}: the GPU kernels' summation order)"
            )
        else:
            lines.append("note: the variants' losses differ from none's (see the JSON)")
    lines += [t["line"] for t in result["targets"]]
    return "\n".join(lines)


def check(result: dict[str, Any]) -> None:
    for name, row in result["summary"].items():
        if "error" not in row and not row["median_step_s"] > 0:
            raise ConfigError(f"bench memory: {name} measured a zero step time")
    if not all(r["variants"]["none"]["peak_reset"] for r in result["rounds"]):
        raise ConfigError("bench memory: cannot reset the RSS high-water mark (needs Linux /proc)")


def parse_budgets(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"--budgets: expected fractions like 0.5,0.3, got {text!r}") from None


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--budgets", default="0.75,0.5,0.3", help="phalanx budgets, fractions of the unmanaged peak"
    )


def budgets_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {"budgets": parse_budgets(args.budgets)}


common.register("memory-layers",
                "in-process: offload/recompute plan vs checkpoint, save_on_cpu",
                MemoryBenchConfig, run_benchmark, check, format_report,
                skip=("budgets", "fresh_processes"), flags=add_flags,
                from_flags=budgets_from_flags)  # fmt: skip
