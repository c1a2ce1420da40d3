"""``phalanx bench optimizer``: the optimizer state in memory vs in the next tier (F19): ``device``,
``host`` (``stream``) and ``mirror`` on an MLP whose Adam state dominates, fresh processes per
round. Method: docs/bench-methods.md, "optimizer"."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from phalanx import bench as common
from phalanx.bench.memory_layers import (
    LOSS_RTOL,
    _Allocator,
    check_device,
    in_fresh_process,
    relative_diff,  # fmt: skip
)
from phalanx.errors import ConfigError
from phalanx.fields import option
from phalanx.memory import measure
from phalanx.memory.manager import MemoryConfig, MemoryManager
from phalanx.memory.tiers import TierConfig

VARIANTS = ("device", "host", "mirror")
# each variant's [memory] optimizer: on CUDA "host" would resolve to "mirror"
PLACES = {"host": "stream", "mirror": "mirror"}
PEAK_OF = {  # what a run's peak_bytes is, per device type (recorded in the JSON)
    "cpu": "rss: the process's VmHWM over the peak steps above its VmRSS before the model",
    "cuda": "device: torch.cuda.max_memory_allocated over the peak steps above "
    "torch.cuda.memory_allocated before the model",
}


@dataclass(frozen=True, kw_only=True)
class OptimizerBenchConfig:
    """One ``phalanx bench optimizer`` run (recorded in the JSON)."""

    width: int = option(1536, "features per layer")
    layers: int = option(12, "square Linear layers")
    spill_dir: str = option("", "directory of the spill file (default: the temp directory)")
    batch_size: int = option(32, "samples per step")
    chunk_mb: float = option(16.0, "state per streamed chunk, MiB")
    rounds: int = option(3, "fresh-process rounds per variant")
    steps: int = option(4, "timed steps per process")
    device: str = option("cpu", "where the model trains and the peak is measured: cpu or cuda")
    warmup: int = option(1, "untimed steps first")
    peak_steps: int = option(2, "steps the peak covers")
    threads: int = option(1, "intra-op threads per process")
    timeout_s: float = option(600.0, "seconds per measuring process")

    def validate(self) -> None:
        common.at_least(self, 1, "width", "layers", "batch_size", "rounds", "steps", "peak_steps")
        if self.chunk_mb <= 0:
            raise ConfigError(f"--chunk-mb: must be > 0, got {self.chunk_mb}")
        check_device(self.device)


def _model(cfg: OptimizerBenchConfig) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(cfg.layers):
        layers += [nn.Linear(cfg.width, cfg.width), nn.Tanh()]
    return nn.Sequential(*layers)


def measure_variant(cfg: OptimizerBenchConfig, variant: str) -> dict[str, Any]:
    """Train ``variant`` in this process: the peak over ``peak_steps`` steps after the first,
    then the median of ``steps`` timed steps after ``warmup``."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    cpu = device.type == "cpu"
    allocator = _Allocator(enabled=cpu)  # glibc's modes: host memory only
    allocator.measuring()
    gc.collect()
    allocator.trim()
    common.synchronize(device)
    before_model = measure.current_bytes(device)
    model = _model(cfg).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    manager = None
    if variant not in VARIANTS:
        raise ConfigError(f"bench optimizer: unknown variant {variant!r}")
    if variant != "device":
        config = MemoryConfig(
            optimizer=PLACES[variant],
            optimizer_chunk_mb=cfg.chunk_mb,
            tier=TierConfig(directory=cfg.spill_dir),
            release_host_memory=cpu,  # glibc's settings: for host memory, the CPU path's only
        )
        manager = MemoryManager.build([], config, device)
        manager.attach_optimizer(optimizer, model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(cfg.batch_size, cfg.width, generator=g).to(device)
    y = torch.randn(cfg.batch_size, cfg.width, generator=g).to(device)
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
    common.synchronize(device)
    after_first = measure.current_bytes(device)
    reset = measure.reset_peak(device)
    for _ in range(cfg.peak_steps):
        step()
    common.synchronize(device)
    peak = measure.peak_bytes(device)
    # Phase 2: the time.
    allocator.reuse()
    for _ in range(cfg.warmup):
        step()
    times = []
    for _ in range(cfg.steps):
        common.synchronize(device)
        start = time.perf_counter()
        step()
        common.synchronize(device)  # a GPU's step is done when its queued kernels are
        times.append(time.perf_counter() - start)
    held = "rss" if cpu else "device"
    out = {
        "variant": variant,
        "device": cfg.device,
        f"{held}_before_model_bytes": before_model,
        f"{held}_between_steps_bytes": after_first - before_model,
        "peak_bytes": peak - before_model,
        "peak_of": PEAK_OF[device.type],
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


def run_benchmark(cfg: OptimizerBenchConfig) -> dict[str, Any]:
    started = time.perf_counter()
    rounds = []
    for r in range(cfg.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        measured = {v: in_fresh_process(measure_variant, cfg, v) for v in order}
        rounds.append({"order": order, "variants": measured})
    meta = common.machine_meta(
        wall_s=time.perf_counter() - started,
        config=asdict(cfg),
        model=f"MLP: {cfg.layers} x Linear({cfg.width}, {cfg.width}) + tanh, Adam",
        peak_of=PEAK_OF[cfg.device],
    )
    return {"meta": meta, "rounds": rounds, "summary": summarize(rounds, cfg.device)}


def summarize(rounds: list[dict[str, Any]], device: str = "cpu") -> dict[str, Any]:
    """Medians over rounds; each variant's losses against ``device``'s: ``losses_equal`` exact,
    ``losses_agree`` exact on a CPU, on CUDA within ``LOSS_RTOL`` (the mirror steps on the CPU)."""
    variants = [v for v in VARIANTS if v in rounds[0]["variants"]]
    others = [v for v in variants if v != "device"]
    held = "rss" if device == "cpu" else "device"
    equal = {
        v: all(r["variants"][v]["losses"] == r["variants"]["device"]["losses"] for r in rounds)
        for v in others
    }
    rel = {v: _max_rel_diff(rounds, v) for v in others}
    lengths = {
        v: all(
            len(r["variants"][v]["losses"]) == len(r["variants"]["device"]["losses"])
            for r in rounds
        )
        for v in others
    }

    def median(variant: str, key: str) -> float:
        return statistics.median(r["variants"][variant][key] for r in rounds)

    def ratio(variant: str, key: str) -> float:
        return statistics.median(
            r["variants"][variant][key] / r["variants"]["device"][key] for r in rounds
        )

    return {
        "variants": variants,
        "peak_bytes": {v: median(v, "peak_bytes") for v in variants},
        "between_steps_bytes": {v: median(v, f"{held}_between_steps_bytes") for v in variants},
        "median_step_s": {v: median(v, "median_step_s") for v in variants},
        "step_time_ratio": {v: ratio(v, "median_step_s") for v in others},
        "peak_ratio": {v: ratio(v, "peak_bytes") for v in others},
        "tier_bytes": {v: median(v, "tier_bytes") for v in others},
        "params_bytes": median("device", "params_bytes"),
        "losses_equal": equal,
        "max_loss_rel_diff": rel,
        "losses_agree": {
            v: equal[v] or (device != "cpu" and lengths[v] and rel[v] <= LOSS_RTOL) for v in others
        },
        "device": device,
    }


def _max_rel_diff(rounds: list[dict[str, Any]], variant: str) -> float:
    return max(
        (
            relative_diff(a, b)
            for r in rounds
            for a, b in zip(r["variants"][variant]["losses"], r["variants"]["device"]["losses"])
        ),
        default=0.0,
    )


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
    agree = s.get("losses_agree", s["losses_equal"])
    for v in s["variants"][1:]:
        losses = "identical" if s["losses_equal"][v] else "DIFFER"
        if not s["losses_equal"][v] and agree[v]:
            losses = f"agree within {s['max_loss_rel_diff'][v]:.1e} relative (CPU vs GPU rounding)"
        lines.append(
            f"{v} vs device: peak {100 * (s['peak_ratio'][v] - 1):+.1f}%, step time "
            f"{100 * (s['step_time_ratio'][v] - 1):+.1f}% (medians of per-round ratios); "
            f"losses {losses}"
        )
    if s.get("device", "cpu") == "cuda":
        lines.append(
            "held: what the variant keeps outside the device optimizer (host: the state in "
            "pinned host memory; mirror: fp32 masters, gradient buffers and state in pinned host "
            "memory); peak and between: CUDA allocated bytes above those before the model"
        )
    else:
        lines.append(
            "held: what the variant keeps outside the device optimizer (host: the state in the "
            "spill file; mirror: fp32 masters, gradient buffers and state in host memory)"
        )
    return "\n".join(lines)


def check(result: dict[str, Any]) -> None:
    summary = result["summary"]
    for variant, agree in summary.get("losses_agree", summary["losses_equal"]).items():
        if not agree:
            raise ConfigError(
                f"bench optimizer: the {variant} optimizer's losses differ from torch's"
            )


common.register("optimizer", "optimizer state in memory vs in the spill file",
                OptimizerBenchConfig, run_benchmark, check, format_report)  # fmt: skip
