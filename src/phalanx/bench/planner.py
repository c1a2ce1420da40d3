"""``phalanx bench planner``: the planner's predicted step time against measured steps here (the
oracle mode: the simulator is fed each run's own measured compute, so the error measures the
model of the exchange and its overlap; docs/planner.md, "The oracle mode").

Phases (docs/bench-methods.md, "planner"):
  Phase 1 (calibrate, before every round of blocks): link, message, hand-over, codec and add costs.
  Phase 2 (measure): the timed steps' mean, and each step's straggler's traced compute.
  Phase 3 (predict, after the last round): the simulator on the rounds' median calibration."""

from __future__ import annotations

import copy
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import phalanx as px
from phalanx import bench as common
from phalanx.bench.planner_validation import (
    check_validation,
    format_validation,
    run_validation,
    validate_paths,
)
from phalanx.costs import LayerCost
from phalanx.engine.tracing import TRACE_FILE, StepTracer, TraceConfig
from phalanx.errors import ConfigError
from phalanx.exchange.comm import measure_handoff_s
from phalanx.exchange.link import LinkModel, calibrate, measure_message_s
from phalanx.fields import option
from phalanx.models.layers import build_layers
from phalanx.models.zoo import digits_cnn, mlp
from phalanx.planner.cluster import from_link, measure_add_s_per_byte, measure_codec_s_per_byte
from phalanx.planner.sim import ExchangeSetup, Simulator
from phalanx.planner.step import StepProfile
from phalanx.planner.trace import read_trace
from phalanx.runtime.context import RuntimeConfig

MODELS = ("digits_cnn", "mlp", "char_lstm")
STRATEGIES = ("allreduce", "tree", "partitioned", "ps", "fsdp")
NO_ORACLE = {"fsdp": "no buckets whose measured compute could feed the oracle"}
TARGET = 0.10  # |predicted / measured - 1| at 2 processes (issue 13)


@dataclass(frozen=True, kw_only=True)
class PlannerBenchConfig:
    """One ``phalanx bench planner`` run (picklable: sent to the workers)."""

    config: tuple[str, ...] = option(
        (),
        "run configs to validate the prediction before the run on (repeatable); without "
        "it, the oracle mode: the bench models with their measured compute (a diagnostic)",
    )
    worlds: tuple[int, ...] = option((1, 2, 3), "with --config: processes per run")
    nproc: int = option(2, "oracle mode: processes (above the cores: oversubscribed)")
    models: tuple[str, ...] = option(MODELS, "bench models")
    strategies: tuple[str, ...] = option(STRATEGIES, "exchange strategies")
    compress: tuple[str, ...] = option(("none", "fp16"), "none, fp16")
    thresholds: tuple[str, ...] = option(("25", "auto"), "MiB or auto")
    warmup: int = option(3, "untimed steps per cell first")
    steps: int = option(12, "timed (and traced) steps per block")
    blocks: int = option(
        3, "timed blocks per cell, alternating over the cells; a cell's error is its median block's"
    )
    threads: int = option(1, "intra-op threads per process")
    train_steps: int = option(40, "with --config: training steps per phalanx train run")
    rounds: int = option(1, "with --config: rounds over every cell (order reversed each round)")
    timeout_s: float = option(300.0, "with --config: seconds per phalanx train process")
    cached_slowdown: bool = option(
        False,
        "with --config, a diagnostic: also predict each cell with the cached calibration's "
        "compute slow-down instead of the one probed before the config's cells (as phalanx "
        "plan does), reported beside the figures",
    )

    def validate(self) -> None:
        if self.config:
            validate_paths(self.config)
            if not self.worlds or min(self.worlds) < 1 or self.rounds < 1:
                raise ConfigError("--worlds: sizes >= 1; --rounds: >= 1")
            if self.train_steps < 10:
                raise ConfigError("--train-steps: at least 10 training steps per run")
        if self.nproc < 2:
            raise ConfigError("--nproc: the exchange needs at least 2 processes")
        if self.steps < 3:
            raise ConfigError("--steps: at least 3 timed steps")
        if self.blocks < 1:
            raise ConfigError("--blocks: at least 1 timed block per cell")
        common.known("--models", self.models, MODELS, what="model ")
        for t in self.thresholds:
            if t != "auto" and not _is_positive_number(t):
                raise ConfigError(f"--thresholds: {t!r} is neither 'auto' nor a size in MiB")


def _is_positive_number(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def _model_and_batch(name: str, batch: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model and one random batch of its input shape (timing does not depend on values)."""

    torch.manual_seed(0)
    if name == "digits_cnn":
        return digits_cnn(), torch.randn(batch, 1, 8, 8), torch.randint(0, 10, (batch,))
    if name == "mlp":
        return mlp(), torch.randn(batch, 1024), torch.randint(0, 10, (batch,))
    layers = [
        {"type": "embedding", "num_embeddings": 97, "embedding_dim": 64},
        {"type": "lstm", "input_size": 64, "hidden_size": 256},
        {"type": "linear", "in_features": 256, "out_features": 97},
    ]
    tokens = torch.randint(0, 97, (batch, 65))
    return build_layers(layers), tokens[:, :-1], tokens[:, 1:]


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


# -- inside the workers -----------------------------------------------------------------------
def _calibrate(ctx: Any) -> tuple[Any, float, float]:
    """Phase 1, once per round: the link (with a message's and a thread hand-over's software
    cost), the fp16 codec's and an uncompressed add's seconds per byte."""

    link = calibrate(ctx.group, ctx.device)
    link = replace(
        link,
        message_samples_s=measure_message_s(ctx.group, ctx.device),
        handoff_samples_s=measure_handoff_s(),  # every rank at once, as in a step
    )
    return link, measure_codec_s_per_byte("fp16"), measure_add_s_per_byte()


def _worker(ctx: Any, cfg: PlannerBenchConfig, model_name: str) -> list[dict[str, Any]] | None:
    batch = 32
    model, x, y = _model_and_batch(model_name, batch)
    cells = [
        (strategy, compress, threshold)
        for strategy in cfg.strategies
        if strategy not in NO_ORACLE
        for compress in cfg.compress
        for threshold in cfg.thresholds
    ]
    blocks: dict[tuple[str, str, str], list[dict[str, Any]]] = {cell: [] for cell in cells}
    calibrations = []
    for _ in range(cfg.blocks):  # every cell once per round: a slow minute hits one block each
        calibrations.append(_calibrate(ctx))
        for cell in cells:  # Phase 2
            blocks[cell].append(_cell(ctx, cfg, model, x, y, cell))
    if ctx.rank != 0:
        return None
    # Phase 3: every block predicted from the rounds' median calibration.
    link = LinkModel.median_of([c[0] for c in calibrations])
    cluster = from_link(
        link,
        devices_per_node=ctx.world_size,
        codec_s_per_byte=statistics.median(c[1] for c in calibrations),
        add_s_per_byte=statistics.median(c[2] for c in calibrations),
        host_cores=_host_cores(),  # the processes are CPU ranks sharing this machine's cores
    )
    rounds = [_calibration_summary(*c) for c in calibrations]
    for cell in cells:
        for block in blocks[cell]:
            _simulate(block, cluster, ctx.world_size)
    return [{**_row(model_name, blocks[cell]), "calibrations": rounds} for cell in cells]


def _host_cores() -> int:
    """The cores this process may run on (its affinity; all of them where that is unknown)."""
    import os

    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _calibration_summary(link: Any, codec_s: float, add_s: float) -> dict[str, Any]:
    """One round's calibration, for the report (seconds, bytes per second)."""
    return {
        "add_s_per_byte": add_s,
        "alpha_s": link.alpha_s,
        "beta_bytes_per_s": link.beta_bytes_per_s,
        "message_mean_s": link.message_s,
        "handoff_median_s": link.handoff_s,
        "codec_s_per_byte": codec_s,
    }


def _simulate(block: dict[str, Any], cluster: Any, world: int) -> None:
    """Predict a measured block: one simulated step per timed step's profile, their mean."""

    setup = ExchangeSetup(**block["setup"])
    runs = [
        Simulator(StepProfile.from_dict(p), cluster, measured_beside_exchange=True).run(
            world, setup
        )
        for p in block["profiles"]
    ]
    block["cluster"] = cluster.to_dict()
    block["predicted_s"] = statistics.fmean(r.step_s for r in runs)
    block["predicted_exposed_s"] = statistics.fmean(r.exposed_s for r in runs)
    block["simulated_buckets"] = len(runs[0].bucket_bytes)


def _row(model_name: str, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell: its blocks, and the numbers of its median block (by error) for the table."""
    for block in blocks:
        block["error"] = block["predicted_s"] / block["measured_s"] - 1
    median = sorted(blocks, key=lambda b: b["error"])[(len(blocks) - 1) // 2]
    summary = {k: v for k, v in median.items() if k not in ("profiles", "measured_samples")}
    return {"model": model_name, **summary, "blocks": blocks}


def _cell(
    ctx: Any,
    cfg: PlannerBenchConfig,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    setup: tuple[str, str, str],
) -> dict[str, Any]:
    strategy, compress, threshold = setup

    engine = px.Engine(
        copy.deepcopy(model),
        _loss,
        lambda ps: torch.optim.Adam(ps, lr=1e-4),
        exchange=strategy,
        compress=None if compress == "none" else compress,
        bucket_mb="auto" if threshold == "auto" else float(threshold),
        context=ctx,
    )
    for _ in range(cfg.warmup):
        engine.step(x, y)
    while engine.auto is not None and not engine.auto.done:
        engine.step(x, y)
    # Phase 2: time and trace the same consecutive steps.
    directory = tempfile.mkdtemp(prefix="phalanx-plan-bench-")
    trace = TraceConfig(directory=directory, first_step=engine.num_steps + 1, num_steps=cfg.steps)
    engine.trace.tracer = StepTracer(trace, ctx.rank, ctx.device)
    dist.barrier(group=ctx.group)
    times = []
    for _ in range(cfg.steps):
        start = time.perf_counter()
        engine.step(x, y)
        times.append(time.perf_counter() - start)
    per_rank: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(per_rank, list(times), group=ctx.group)
    state_bytes: list[Any] = [None] * ctx.world_size  # whose optimizer updates how much
    dist.all_gather_object(state_bytes, engine.optimizer_bytes(), group=ctx.group)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=ctx.group)
    # The block's mean step (what throughput is), the slower rank's: a per-step maximum over
    # ranks would add the two ranks' independent jitter to every step.
    measured = max(sum(t) / len(t) for t in per_rank)
    row: dict[str, Any] = {
        "strategy": strategy,
        "compress": compress,
        "threshold": threshold,
        "bucket_bytes": engine.buckets.bucket_bytes,
        "first_bucket_bytes": engine.buckets.first_bucket_bytes,
        "num_buckets": len(engine.buckets.buckets),
        "measured_s": measured,
        "measured_median_max_s": statistics.median(slowest.tolist()),
        "measured_samples": slowest.tolist(),
    }
    if ctx.rank == 0:
        costs = (per_rank, state_bytes)
        row.update(_profiles(engine, trace, strategy, compress, x.shape[0], costs))
    engine.close()
    shutil.rmtree(directory, ignore_errors=True)
    return row


def _profiles(
    engine: Any,
    trace: Any,
    strategy: str,
    compress: str,
    batch: int,
    costs: tuple[list[list[float]], list[int]],
) -> dict[str, Any]:
    """The block's compute, one step profile per timed step, for Phase 3 to simulate.

    A synchronous step waits for the rank that computes slowest *in that step* (this VM's
    jitter moves between the ranks), so each step's profile comes from that step's straggler:
    the rank with the most forward and backward (forward less its waits for parameters; not
    the exchange wait, which the simulator predicts). The optimizer's cost per byte is the
    slowest updater's in that step, per byte of what it updates (with ``partitioned`` at two
    ranks one owner updates everything and the other nothing: the simulator's rank is the
    owner; ``ps`` servers' updates inside the exchange are traced on the communication
    thread). The step's time outside its traced phases (the Engine's bookkeeping around them:
    zeroing and arming buckets, the guard's checks, launching) is a fixed cost of the compute
    stream. ``costs``: each rank's own time of every timed step and its optimizer state bytes."""
    step_times, state_bytes = costs
    from pathlib import Path

    every = read_trace(Path(trace.directory) / TRACE_FILE)
    steps = sorted({e["args"]["step"] for e in every})
    ranks = sorted({e["pid"] for e in every})
    by: dict[tuple[Any, Any], list[dict[str, Any]]] = {(r, s): [] for r in ranks for s in steps}
    for e in every:
        by[(e["pid"], e["args"]["step"])].append(e)
    grad_bytes = sum(p.numel() * p.element_size() for b in engine.buckets.buckets for p in b.params)
    profiles, stragglers = [], []
    for k, s in enumerate(steps):

        def compute_s(r: Any, s: Any = s) -> float:
            return _compute_s(by[(r, s)])

        slow = max(ranks, key=compute_s)
        stragglers.append(slow)
        per_byte = max(  # Adam: two state bytes per gradient byte it updates
            _optimizer_s(by[(r, s)]) / min(grad_bytes, state_bytes[r] / 2)
            for r in ranks
            if state_bytes[r] > 0
        )
        profile = _step_profile(by[(slow, s)], step_times[slow][k], engine, batch, per_byte)
        profiles.append(profile)
    return {
        "profiles": [p.to_dict() for p in profiles],  # with "cluster" and "setup": enough to
        "setup": {  # simulate again
            "strategy": strategy,
            "bucket_bytes": engine.buckets.bucket_bytes,
            "first_bucket_bytes": engine.buckets.first_bucket_bytes,
            "compress": compress,
        },
        "forward_s": statistics.fmean(p.forward_s for p in profiles),
        "backward_s": statistics.fmean(p.backward_s for p in profiles),
        "optimizer_s": statistics.fmean(p.optimizer_s for p in profiles),
        "overhead_s": statistics.fmean(p.engine_s for p in profiles),
        "stragglers": stragglers,
    }


def _compute_s(events: list[dict[str, Any]]) -> float:
    """One rank's forward and backward in one step (seconds): the compute before the
    exchange that a synchronous step waits for (forward less its waits for parameters)."""
    busy = sum(e["dur"] for e in events if e["lane"] == "compute")
    return (busy - sum(e["dur"] for e in events if e["name"].startswith("parameters"))) / 1e6


def _optimizer_s(events: list[dict[str, Any]]) -> float:
    """One rank's optimizer in one step (seconds): its servers' updates inside the exchange
    ("update b3", ``ps``), else the step's update slice."""
    updates = [e for e in events if e["lane"] == "optimizer"]
    inside = [e for e in updates if e["name"].startswith("update b")]
    return sum(e["dur"] for e in inside or updates) / 1e6


def _step_profile(
    events: list[dict[str, Any]], step_s: float, engine: Any, batch: int, per_byte: float
) -> Any:
    """The profile of one rank's step from its trace slices (``step_s``: its measured time)."""

    def total(select: Any) -> float:
        return sum(e["dur"] for e in events if select(e)) / 1e6

    # Forward's own compute: its slices less the waits for parameters inside them (the
    # simulator adds the waits its model predicts).
    forward_s = total(lambda e: e["name"] == "forward") - total(
        lambda e: e["name"].startswith("parameters")
    )
    buckets = engine.buckets.buckets
    backward = [total(lambda e, b=b.index: e["name"] == f"backward b{b}") for b in buckets]
    total_backward = sum(backward) or 1.0
    layers = [
        LayerCost(
            name=f"bucket {b.index}",
            forward_s=forward_s * seconds / total_backward,
            backward_s=seconds,
            grad_bytes=tuple(p.numel() * p.element_size() for p in b.params),
        )
        for b, seconds in zip(buckets, backward)
    ]
    traced = total(_on_compute_stream)
    return StepProfile(
        layers=layers,
        batch_size=batch,
        optimizer_s_per_byte=per_byte,
        input_s=total(lambda e: e["lane"] == "input"),
        engine_s=max(0.0, step_s - traced),
        source="phalanx bench planner: one step of its straggler's trace",
    )


def _on_compute_stream(event: dict[str, Any]) -> bool:
    """Whether a trace slice is the main thread's own time, one after another: not the
    exchange, not a wait for parameters (nested inside forward) and not a ``ps`` server's
    update ("update b3": on the communication thread, while the main thread waits)."""
    lane, name = event["lane"], event["name"]
    nested = name.startswith("parameters") or (lane == "optimizer" and name.startswith("update b"))
    return lane != "exchange" and not nested


# -- in the caller ----------------------------------------------------------------------------
def run_benchmark(cfg: PlannerBenchConfig) -> dict[str, Any]:
    from phalanx.runtime.spawn import run_ranks

    if cfg.config:  # predicted before the run, measured as users run it
        return run_validation(cfg)
    started = time.perf_counter()
    runtime = RuntimeConfig(threads=cfg.threads)
    rows: list[dict[str, Any]] = []
    for name in cfg.models:
        rows += run_ranks(_worker, cfg.nproc, cfg, name, timeout=900 * cfg.blocks, runtime=runtime)[
            0
        ]
    meta = common.machine_meta(wall_s=time.perf_counter() - started, config=asdict(cfg))
    return {"meta": meta, "rows": rows}


def format_report(result: dict[str, Any]) -> str:
    if "halves" in result:
        return format_validation(result)
    lines = [
        "oracle mode (a diagnostic): the simulator fed each run's own measured compute; the "
        "prediction before the run is `phalanx bench planner --config A.toml ...`",
        f"{'model':<11} {'strategy':<12} {'compress':<8} {'threshold':<9} {'buckets':>7} "
        f"{'measured ms':>11} {'predicted ms':>12} {'error':>7}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['model']:<11} {r['strategy']:<12} {r['compress']:<8} {r['threshold']:<9} "
            f"{r['num_buckets']:>7} {1e3 * r['measured_s']:>11.2f} "
            f"{1e3 * r['predicted_s']:>12.2f} {100 * r['error']:>+6.1f}%"
        )
    errors = [abs(r["error"]) for r in result["rows"]]
    within = sum(e <= TARGET for e in errors)
    lines.append(
        f"within {100 * TARGET:.0f}%: {within} of {len(errors)} cells; median |error| "
        f"{100 * statistics.median(errors):.1f}%, worst {100 * max(errors):.1f}%"
    )
    left = [s for s in result["meta"]["config"]["strategies"] if s in NO_ORACLE]
    lines += [f"{s}: not in the oracle mode ({NO_ORACLE[s]})" for s in left]
    return "\n".join(lines)


def check(result: dict[str, Any]) -> None:
    if "halves" in result:
        return check_validation(result)
    blocks = [b for r in result["rows"] for b in r["blocks"]]
    if not all(b["measured_s"] > 0 and b["predicted_s"] > 0 for b in blocks):
        raise ConfigError("bench planner: a zero step time was measured or predicted")


common.register("planner", "the planner's predicted step time vs measured here",
                PlannerBenchConfig, run_benchmark, check, format_report)  # fmt: skip
