"""``phalanx bench optimizer``: the optimizer state in memory vs in the next tier (F19).

A model whose parameters dominate (an MLP of square layers, Adam: its state is twice the
parameters) trains in two ways, each in a fresh process per round, the order alternating:

- ``device``: the optimizer as torch runs it, state in memory;
- ``host``: ``[memory] optimizer = "host"``: the state in the spill file between steps,
  streamed through memory chunk by chunk (phalanx.memory.mirror), on the same data;
- ``mirror``: ``[memory] optimizer = "mirror"``: fp32 masters, state and arithmetic on the
  host (phalanx.memory.host_mirror); on this CPU-only machine the host is the device, so it
  holds a second copy of the parameters and saves no memory: what it shows here is the cost of
  its copies and the overlap of the optimizer (a worker thread) with the next forward.

Measured per process: the peak RSS of a step above the RSS before the model existed (the
process's interpreter and torch), over steps after the first (which creates the state), with
large blocks mapped on their own so frees show (bench memory's allocator modes); the median step
time over timed steps after a warm-up, freed blocks reused; the losses (the two must agree
exactly) and the bytes the tier holds. Reported: peaks, their change, step times and their
ratio (medians over rounds).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from phalanx.bench import machine_meta
from phalanx.bench.memory import _Allocator, _allocator_env
from phalanx.errors import ConfigError
from phalanx.fields import option
from phalanx.memory import measure
from phalanx.memory.manager import MemoryConfig, MemoryManager
from phalanx.memory.tiers import TierConfig
from phalanx.runtime.context import RuntimeConfig

VARIANTS = ("device", "host", "mirror")


@dataclass(frozen=True)
class OptimizerBenchConfig:
    """One ``phalanx bench optimizer`` run (recorded in the JSON)."""

    width: int = option(1536, "features per layer")
    layers: int = option(12, "square Linear layers")
    batch_size: int = option(32, "samples per step")
    chunk_mb: float = option(16.0, "state per streamed chunk, MiB")
    rounds: int = option(3, "fresh-process rounds per variant")
    steps: int = option(4, "timed steps per process")
    warmup: int = option(1, "untimed steps first")
    peak_steps: int = option(2, "steps the peak covers")
    threads: int = option(1, "intra-op threads per process")
    spill_dir: str = option("", "directory of the spill file (default: the temp directory)")
    timeout_s: float = option(600.0, "seconds per measuring process")

    @property
    def nproc(self) -> int:
        return 1

    def validate(self) -> None:
        for key in ("width", "layers", "batch_size", "rounds", "steps", "peak_steps"):
            if getattr(self, key) < 1:
                raise ConfigError(f"--{key.replace('_', '-')}: must be >= 1")
        if self.chunk_mb <= 0:
            raise ConfigError(f"--chunk-mb: must be > 0, got {self.chunk_mb}")


def _model(cfg: OptimizerBenchConfig) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(cfg.layers):
        layers += [nn.Linear(cfg.width, cfg.width), nn.Tanh()]
    return nn.Sequential(*layers)


def measure_variant(cfg: OptimizerBenchConfig, variant: str) -> dict[str, Any]:
    """Train ``variant`` in this process: peak RSS over ``peak_steps`` steps after the first,
    then the median of ``steps`` timed steps after ``warmup``."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    allocator = _Allocator()
    allocator.measuring()
    gc.collect()
    allocator.trim()
    before_model = measure.current_rss_bytes()
    model = _model(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    manager = None
    if variant not in VARIANTS:
        raise ConfigError(f"bench optimizer: unknown variant {variant!r}")
    if variant != "device":
        config = MemoryConfig(
            optimizer=variant,
            optimizer_chunk_mb=cfg.chunk_mb,
            tier=TierConfig(directory=cfg.spill_dir),
        )
        manager = MemoryManager.build([], config, torch.device("cpu"))
        manager.attach_optimizer(optimizer, model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(cfg.batch_size, cfg.width, generator=g)
    y = torch.randn(cfg.batch_size, cfg.width, generator=g)
    losses: list[float] = []

    def step() -> None:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))

    # Phase 1: the peak (the first step creates the optimizer state).
    step()
    gc.collect()
    allocator.trim()
    after_first = measure.current_rss_bytes()
    reset = measure.reset_peak()
    for _ in range(cfg.peak_steps):
        step()
    peak = measure.peak_bytes()
    # Phase 2: the time.
    allocator.reuse()
    for _ in range(cfg.warmup):
        step()
    times = []
    for _ in range(cfg.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    out = {
        "variant": variant,
        "rss_before_model_bytes": before_model,
        "rss_between_steps_bytes": after_first - before_model,
        "peak_bytes": peak - before_model,
        "peak_reset": reset,
        "step_s": times,
        "median_step_s": statistics.median(times),
        "losses": losses,
        "params_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "tier_bytes": 0,
    }
    if manager is not None:
        assert manager.mirror is not None
        out["tier_bytes"] = manager.mirror.stored_bytes()
        out["chunks_per_step"] = manager.mirror.num_chunks_stepped / len(losses)
        manager.close()
    return out


def _worker(ctx: Any, cfg: OptimizerBenchConfig, variant: str) -> dict[str, Any]:
    return measure_variant(cfg, variant)


def run_benchmark(cfg: OptimizerBenchConfig) -> dict[str, Any]:
    from phalanx.runtime.spawn import run_ranks

    cfg.validate()
    started = time.perf_counter()
    runtime = RuntimeConfig(threads=cfg.threads, timeout_s=cfg.timeout_s)
    rounds = []
    for r in range(cfg.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        measured = {}
        for variant in order:
            with _allocator_env():
                measured[variant] = run_ranks(
                    _worker, 1, cfg, variant, timeout=cfg.timeout_s, runtime=runtime
                )[0]
        rounds.append({"order": order, "variants": measured})
    meta = {
        **machine_meta(),
        "wall_s": time.perf_counter() - started,
        "config": asdict(cfg),
        "model": f"MLP: {cfg.layers} x Linear({cfg.width}, {cfg.width}) + tanh, Adam",
    }
    return {"meta": meta, "rounds": rounds, "summary": summarize(rounds)}


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    variants = [v for v in VARIANTS if v in rounds[0]["variants"]]
    others = [v for v in variants if v != "device"]

    def median(variant: str, key: str) -> float:
        return statistics.median(r["variants"][variant][key] for r in rounds)

    def ratio(variant: str, key: str) -> float:
        """Median over rounds of ``variant``'s ``key`` over the device variant's."""
        return statistics.median(
            r["variants"][variant][key] / r["variants"]["device"][key] for r in rounds
        )

    return {
        "variants": variants,
        "peak_bytes": {v: median(v, "peak_bytes") for v in variants},
        "between_steps_bytes": {v: median(v, "rss_between_steps_bytes") for v in variants},
        "median_step_s": {v: median(v, "median_step_s") for v in variants},
        "step_time_ratio": {v: ratio(v, "median_step_s") for v in others},
        "peak_ratio": {v: ratio(v, "peak_bytes") for v in others},
        "tier_bytes": {v: median(v, "tier_bytes") for v in others},
        "params_bytes": median("device", "params_bytes"),
        "losses_equal": {
            v: all(r["variants"][v]["losses"] == r["variants"]["device"]["losses"] for r in rounds)
            for v in others
        },
    }


def format_report(result: dict[str, Any]) -> str:
    s, mib = result["summary"], 2**20
    lines = [
        f"{result['meta']['model']}: parameters {s['params_bytes'] / mib:.0f} MiB",
        f"{'optimizer':<10} {'peak MiB':>9} {'between MiB':>12} {'held MiB':>9} {'step ms':>8}",
    ]
    for v in s["variants"]:
        lines.append(
            f"{v:<10} {s['peak_bytes'][v] / mib:>9.0f} {s['between_steps_bytes'][v] / mib:>12.0f} "
            f"{s['tier_bytes'].get(v, 0) / mib:>9.0f} {1e3 * s['median_step_s'][v]:>8.0f}"
        )
    for v in s["variants"][1:]:
        lines.append(
            f"{v} vs device: peak {100 * (s['peak_ratio'][v] - 1):+.1f}%, step time "
            f"{100 * (s['step_time_ratio'][v] - 1):+.1f}% (medians of per-round ratios); "
            f"losses {'identical' if s['losses_equal'][v] else 'DIFFER'}"
        )
    lines.append(
        "held: what the variant keeps outside the device optimizer (host: the state in the "
        "spill file; mirror: fp32 masters, gradient buffers and state in host memory)"
    )
    return "\n".join(lines)


def _check(result: dict[str, Any]) -> None:
    for variant, equal in result["summary"]["losses_equal"].items():
        if not equal:
            raise ConfigError(
                f"bench optimizer: the {variant} optimizer's losses differ from torch's"
            )
