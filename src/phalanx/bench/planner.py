"""``phalanx bench planner``: the planner's predicted step time against measured steps here.

For each model (the digits CNN, the 8.4 M-parameter MLP, the char-LSTM), strategy, compression
and threshold (25 MiB, ``auto``), two processes train with the Engine; after a warm-up (and
after ``auto`` settled) ``steps`` consecutive steps are timed and traced
(``phalanx.tracing``): the measured step is the slower rank's mean over them. The planner
then predicts the same step:

  Phase 1 (calibrate, once per model): the link's alpha and beta (``exchange.link.calibrate``,
    the fit ``phalanx bench link`` makes), the fp16 codec's seconds per byte and Adam's
    seconds per gradient byte on the model's parameters.
  Phase 2 (measure): the timed steps' median, and from the trace of them (the rank that
    computes slowest) the compute the simulator needs: forward, backward per bucket (each
    bucket's gradients, in ready order) and the step's time outside its traced phases (the
    Engine's own work).
  Phase 3 (predict): ``planner.sim.Simulator`` on a one-node cluster built from the link, with
    the run's bucket threshold and first bucket: the strategy's message schedule, overlap with
    backward, the optimizer. Its step time against the measured median: the error.

The compute inputs come from the run itself, so the error measures the planner's model of the
exchange and its overlap, not a prediction of compute speed (docs/planner.md).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.errors import ConfigError

MODELS = ("digits_cnn", "mlp", "char_lstm")
STRATEGIES = ("allreduce", "tree", "partitioned", "ps")
TARGET = 0.10  # |predicted / measured - 1| at 2 processes (issue 13)


@dataclass(frozen=True)
class PlannerBenchConfig:
    """One ``phalanx bench planner`` run (picklable: sent to the workers)."""

    nproc: int = 2
    models: tuple[str, ...] = MODELS
    strategies: tuple[str, ...] = STRATEGIES
    compress: tuple[str, ...] = ("none", "fp16")
    thresholds: tuple[str, ...] = ("25", "auto")
    warmup: int = 3
    steps: int = 12
    threads: int = 1

    def validate(self) -> None:
        if self.nproc < 2:
            raise ConfigError("--nproc: the exchange needs at least 2 processes")
        if self.steps < 3:
            raise ConfigError("--steps: at least 3 timed steps")
        for name in self.models:
            if name not in MODELS:
                raise ConfigError(f"--models: unknown model {name!r}; known: {', '.join(MODELS)}")
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
    from phalanx.models.layers import build_layers
    from phalanx.models.zoo import digits_cnn, mlp

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
def _worker(ctx: Any, cfg: PlannerBenchConfig, model_name: str) -> list[dict[str, Any]] | None:
    from phalanx.exchange.link import calibrate
    from phalanx.planner.cluster import from_link, measure_codec_s_per_byte

    # Phase 1: calibrate the link and the codec.
    link = calibrate(ctx.group, ctx.device)
    codec_s = measure_codec_s_per_byte("fp16")
    cluster = from_link(link, devices_per_node=ctx.world_size, codec_s_per_byte=codec_s)
    batch = 32
    model, x, y = _model_and_batch(model_name, batch)
    optimizer_s_per_byte = _optimizer_cost(model)
    rows = []
    for strategy in cfg.strategies:
        for compress in cfg.compress:
            for threshold in cfg.thresholds:
                setup = (strategy, compress, threshold)
                row = _cell(ctx, cfg, model, x, y, setup, cluster, optimizer_s_per_byte)
                rows.append({"model": model_name, **row})
    return rows if ctx.rank == 0 else None


def _optimizer_cost(model: nn.Module, repeats: int = 5) -> float:
    """Seconds per gradient byte of the runs' optimizer (Adam) stepping this model's
    parameters: the median of ``repeats`` steps after one that creates the state; for
    strategies whose servers update inside the exchange, where the trace's optimizer slice
    does not see the update."""
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.Adam(params, lr=1e-4)
    optimizer.step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / sum(p.numel() * p.element_size() for p in params)


def _cell(
    ctx: Any,
    cfg: PlannerBenchConfig,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    setup: tuple[str, str, str],
    cluster: Any,
    optimizer_s_per_byte: float,
) -> dict[str, Any]:
    strategy, compress, threshold = setup
    import phalanx as px
    from phalanx.tracing import StepTracer, TraceConfig

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
    while not engine.auto_done:
        engine.step(x, y)
    # Phase 2: time and trace the same consecutive steps.
    directory = tempfile.mkdtemp(prefix="phalanx-plan-bench-")
    trace = TraceConfig(directory=directory, first_step=engine.num_steps + 1, num_steps=cfg.steps)
    engine.tracer = StepTracer(trace, ctx.rank, ctx.device)
    dist.barrier(group=ctx.group)
    times = []
    for _ in range(cfg.steps):
        start = time.perf_counter()
        engine.step(x, y)
        times.append(time.perf_counter() - start)
    per_rank: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(per_rank, list(times), group=ctx.group)
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
        costs = (per_rank, optimizer_s_per_byte)
        row.update(_predict(engine, trace, cluster, strategy, compress, x.shape[0], costs))
    engine.close()
    return row


def _predict(
    engine: Any,
    trace: Any,
    cluster: Any,
    strategy: str,
    compress: str,
    batch: int,
    costs: tuple[list[list[float]], float],
) -> dict[str, Any]:
    """Phase 3: the step profile from the trace of the rank that computes slowest (a
    synchronous step waits for it; the simulator assumes every rank computes alike), then the
    simulated step. The step's time outside its traced phases (the Engine's bookkeeping around
    them: zeroing and arming buckets, the guard's checks, launching) is a fixed cost of the
    compute stream. ``costs``: each rank's own time of every timed step, and the optimizer's
    seconds per gradient byte (``_optimizer_cost``)."""
    step_times, optimizer_s_per_byte = costs
    from pathlib import Path

    from phalanx.planner.sim import ExchangeSetup, Simulator
    from phalanx.planner.step import LayerStep, StepProfile
    from phalanx.planner.trace import read_trace
    from phalanx.tracing import TRACE_FILE

    every = read_trace(Path(trace.directory) / TRACE_FILE)
    steps = sorted({e["args"]["step"] for e in every})

    def busy_of(rank: int) -> list[float]:
        return [
            sum(
                e["dur"]
                for e in every
                if e["pid"] == rank and e["args"]["step"] == s and _on_compute_stream(e)
            )
            / 1e6
            for s in steps
        ]

    ranks = sorted({e["pid"] for e in every})
    slow = max(ranks, key=lambda r: statistics.median(busy_of(r)))
    events = [e for e in every if e["pid"] == slow]

    def median_of(select: Any) -> float:
        return statistics.median(
            sum(e["dur"] for e in events if e["args"]["step"] == s and select(e)) / 1e6
            for s in steps
        )

    # Forward's own compute: its slices less the waits for parameters inside them (the
    # simulator adds the waits its model predicts).
    forward_s = median_of(lambda e: e["name"] == "forward") - median_of(
        lambda e: e["name"].startswith("parameters")
    )
    optimizer_s = median_of(lambda e: e["lane"] == "optimizer")
    buckets = engine.buckets.buckets
    backward = [median_of(lambda e, b=b.index: e["name"] == f"backward b{b}") for b in buckets]
    total_backward = sum(backward) or 1.0
    layers = [
        LayerStep(
            name=f"bucket {b.index}",
            forward_s=forward_s * seconds / total_backward,
            backward_s=seconds,
            grad_bytes=tuple(p.numel() * p.element_size() for p in b.params),
        )
        for b, seconds in zip(buckets, backward)
    ]
    # The optimizer: from the trace where the step's optimizer slice holds the update (its
    # share of the state: 1, or 1/owners when sharded); measured apart where servers update
    # while gradients arrive, inside the exchange, which the optimizer slice does not see.
    grad_bytes = sum(sum(layer.grad_bytes) for layer in layers)
    share = min(1.0, engine.optimizer_bytes() / max(1, 2 * grad_bytes))  # Adam: 2 states
    per_byte = optimizer_s / max(1.0, grad_bytes * share)
    if engine.strategy.updates_during_exchange:
        per_byte = optimizer_s_per_byte
    own = step_times[slow]
    overhead_s = max(0.0, (sum(own) - sum(busy_of(slow))) / len(own))
    profile = StepProfile(
        layers=layers,
        batch_size=batch,
        optimizer_s_per_byte=per_byte,
        engine_s=overhead_s,
        source="phalanx bench planner: rank 0's trace",
    )
    setup = ExchangeSetup(
        strategy=strategy,
        bucket_bytes=engine.buckets.bucket_bytes,
        first_bucket_bytes=engine.buckets.first_bucket_bytes,
        compress=compress,
    )
    result = Simulator(profile, cluster).run(engine.ctx.world_size, setup)
    return {
        "profile": profile.to_dict(),  # with "cluster" and "setup": enough to simulate again
        "cluster": cluster.to_dict(),
        "setup": {
            "strategy": strategy,
            "bucket_bytes": setup.bucket_bytes,
            "first_bucket_bytes": setup.first_bucket_bytes,
            "compress": compress,
        },
        "predicted_s": result.step_s,
        "predicted_exposed_s": result.exposed_s,
        "forward_s": forward_s,
        "backward_s": sum(backward),
        "optimizer_s": optimizer_s,
        "overhead_s": overhead_s,
        "profiled_rank": slow,
        "simulated_buckets": len(result.bucket_bytes),
    }


def _on_compute_stream(event: dict[str, Any]) -> bool:
    """Slices that add up to the compute stream's busy time: not the exchange, and not the
    waits for parameters (they lie inside forward's slices)."""
    return event["lane"] != "exchange" and not event["name"].startswith("parameters")


# -- in the caller ----------------------------------------------------------------------------
def run_benchmark(cfg: PlannerBenchConfig) -> dict[str, Any]:
    from phalanx.bench import machine_meta
    from phalanx.runtime.context import RuntimeConfig
    from phalanx.runtime.spawn import run_ranks

    cfg.validate()
    started = time.perf_counter()
    runtime = RuntimeConfig(threads=cfg.threads)
    rows: list[dict[str, Any]] = []
    for name in cfg.models:
        rows += run_ranks(_worker, cfg.nproc, cfg, name, timeout=900, runtime=runtime)[0]
    for r in rows:
        r["error"] = r["predicted_s"] / r["measured_s"] - 1
    meta = {**machine_meta(), "wall_s": time.perf_counter() - started, "config": asdict(cfg)}
    return {"meta": meta, "rows": rows}


def format_report(result: dict[str, Any]) -> str:
    lines = [
        f"{'model':<11} {'strategy':<12} {'compress':<8} {'threshold':<9} {'buckets':>7} "
        f"{'measured ms':>11} {'predicted ms':>12} {'error':>7}"
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
    return "\n".join(lines)


def _check(result: dict[str, Any]) -> None:
    if not all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in result["rows"]):
        raise ConfigError("bench planner: a zero step time was measured or predicted")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``phalanx bench planner``; sets ``handler``."""
    p.add_argument("--models", default=",".join(MODELS), help="comma list")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma list")
    p.add_argument("--compress", default="none,fp16", help="comma list: none, fp16")
    p.add_argument("--thresholds", default="25,auto", help="comma list: MiB or auto")
    p.add_argument("--steps", type=int, default=12, help="timed (and traced) steps per cell")
    p.add_argument("--json", metavar="PATH", help="write every number here")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="tracebacks")
    p.set_defaults(handler=cmd_planner)


def _names(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def cmd_planner(args: argparse.Namespace) -> int:
    from phalanx.bench import run_and_report

    cfg = PlannerBenchConfig(
        models=_names(args.models),
        strategies=_names(args.strategies),
        compress=_names(args.compress),
        thresholds=_names(args.thresholds),
        steps=args.steps,
    )
    return run_and_report(cfg, run_benchmark, _check, format_report, args.json)
