"""``phalanx bench exchange``: one process vs torch DDP vs the phalanx Engine, in one run.

Contenders are built by name from ``ContenderSpec``s (kind + options), so new axes (strategies,
compression, bucket sizes) are more specs, not new code paths. Method: docs/bench-methods.md,
"exchange"."""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from phalanx import bench as common
from phalanx.engine import Engine
from phalanx.errors import ConfigError, WorkerError
from phalanx.exchange.base import strategy_factory
from phalanx.fields import option
from phalanx.models.zoo import MODELS
from phalanx.runtime.context import Context, RuntimeConfig

Batch = tuple[torch.Tensor, torch.Tensor]
StepFn = Callable[[torch.Tensor, torch.Tensor], None]
LR, MOMENTUM = 0.01, 0.9
STAT_FIELDS = (
    "exchange_s",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "step_s",
    "bytes_sent",
    "bytes_received",
)
# ``--strategies`` names -> (registered strategy, its options).
STRATEGY_CONTENDERS: dict[str, tuple[str, tuple[tuple[str, Any], ...]]] = {
    "allreduce": ("allreduce", ()),
    "tree": ("tree", ()),
    "partitioned-cyclic": ("partitioned", (("schedule", "cyclic"),)),
    "partitioned-native": ("partitioned", (("schedule", "native"),)),
    "ps-star": ("ps", (("servers", 0), ("reduce", "star"))),
    "ps-tree": ("ps", (("servers", 0), ("reduce", "tree"))),
}


# -- what is measured -------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchModel:
    """A zoo model with its synthetic input: x (B, *input_shape) float32, y (B,) int64."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    default_steps: int  # steps per round when --steps is not given


BENCH_MODELS = {
    m.name: m
    for m in (
        BenchModel("digits_cnn", (1, 8, 8), 10, default_steps=150),
        BenchModel("mlp", (1024,), 10, default_steps=15),
    )
}


@dataclass(frozen=True)
class ContenderSpec:
    """One column of the benchmark: ``kind`` picks the builder, ``options`` are its arguments."""

    name: str
    kind: str
    options: tuple[tuple[str, Any], ...] = ()


SINGLE_BUCKET = "single"  # --bucket-mb value: the whole model in one bucket


def strategy_contenders(
    names: Sequence[str],
    compress: Sequence[str] = ("none",),
    bucket_mb: Sequence[str] = ("25",),
) -> tuple[ContenderSpec, ...]:
    """single, ddp (and ddp with its fp16 hook when fp16 is asked for), then one phalanx
    contender per (strategy, compression, bucket size); labels name only the varied axes."""
    specs = [ContenderSpec("single", "single"), ContenderSpec("ddp", "ddp")]
    if "fp16" in compress:
        specs.append(ContenderSpec("ddp-fp16hook", "ddp", (("fp16_hook", True),)))
    for name in names:
        for codec in compress:
            for size in bucket_mb:
                parts = [name] * (len(names) > 1 or name != "allreduce")
                parts += [codec] * (len(compress) > 1 or codec != "none")
                parts += [f"{size}MB" if size not in ("auto", SINGLE_BUCKET) else size] * (
                    len(bucket_mb) > 1 or size != "25"
                )
                label = "-".join(["phalanx", *parts])
                specs.append(ContenderSpec(label, "phalanx", _phalanx_options(name, codec, size)))
    return tuple(specs)


def _phalanx_options(name: str, codec: str, size: str) -> tuple[tuple[str, Any], ...]:
    strategy, options = STRATEGY_CONTENDERS[name]
    if size == SINGLE_BUCKET:
        sizes: tuple[tuple[str, Any], ...] = (("bucket_mb", 1e6), ("first_bucket_mb", 1e6))
    else:
        sizes = (("bucket_mb", size if size == "auto" else float(size)),)
    return (("exchange", strategy), ("exchange_options", options), ("compress", codec), *sizes)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Everything one ``phalanx bench exchange`` run needs (picklable: sent to the workers)."""

    nproc: int = option(2, "worker processes")
    models: tuple[str, ...] = option(("digits_cnn", "mlp"), "bench models")
    steps: int | None = option(None, "steps per round and contender (default: per model)")
    rounds: int = option(5, "alternating rounds")
    warmup: int = option(5, "warm-up steps per contender")
    batch_size: int = option(32, "per-process batch")
    seed: int = option(0, "seed of weights and synthetic data")
    # the flags --strategies, --compress and --bucket-mb (contenders_from_flags)
    contenders: tuple[ContenderSpec, ...] = strategy_contenders(["allreduce"])
    timeout_s: float = option(120.0, "collective timeout: a stuck rank fails after this")

    def validate(self) -> None:
        common.at_least(self, 1, "nproc", "rounds", "batch_size", "steps")
        common.at_least(self, 0, "warmup")
        common.known("--models", self.models, tuple(BENCH_MODELS), what="model ")

    def steps_for(self, model: BenchModel) -> int:
        return self.steps if self.steps is not None else model.default_steps


# -- contenders (run inside a worker) ---------------------------------------------------------
@dataclass
class Contender:
    """A built contender. ``step(x, y)`` trains on one batch; ``parallel`` = runs on all ranks."""

    spec: ContenderSpec
    parallel: bool
    step: StepFn
    stats: Callable[[], dict[str, float]] | None = None  # the last step's stats
    close: Callable[[], None] = lambda: None


Builder = Callable[[ContenderSpec, nn.Module, Context], Contender]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _local_step(module: nn.Module, optimizer: torch.optim.Optimizer) -> StepFn:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        F.cross_entropy(module(x), y).backward()
        optimizer.step()

    return step


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> float:
    return float(
        sum(
            t.numel() * t.element_size()
            for state in optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        )
    )


def _build_single(spec: ContenderSpec, model: nn.Module, ctx: Context) -> Contender:
    """Plain local training on rank 0 (no process group involved)."""
    model = model.to(ctx.device)
    optimizer = _sgd(model.parameters())
    stats = lambda: {"optimizer_bytes": _optimizer_bytes(optimizer)}  # noqa: E731
    return Contender(spec, False, _local_step(model, optimizer), stats=stats)


def _build_ddp(spec: ContenderSpec, model: nn.Module, ctx: Context) -> Contender:
    """``DistributedDataParallel(model, **options)``: the PyTorch baseline (defaults: none)."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [ctx.device] if ctx.device.type == "cuda" else None
    options = dict(spec.options)
    fp16_hook = options.pop("fp16_hook", False)
    ddp = DistributedDataParallel(model.to(ctx.device), device_ids=device_ids, **options)
    if fp16_hook:  # torch's own compression baseline: fp16 allreduce, then divide
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
    optimizer = _sgd(ddp.parameters())
    stats = lambda: {"optimizer_bytes": _optimizer_bytes(optimizer)}  # noqa: E731
    return Contender(spec, True, _local_step(ddp, optimizer), stats=stats)


def _build_phalanx(spec: ContenderSpec, model: nn.Module, ctx: Context) -> Contender:
    """``phalanx.Engine(model, ..., **options)`` (options: exchange, bucket_mb, compress...)."""

    options = dict(spec.options)
    strategy = strategy_factory(
        options.pop("exchange", "allreduce"), dict(options.pop("exchange_options", ()))
    )
    engine = Engine(
        model, F.cross_entropy, optimizer=_sgd, context=ctx, exchange=strategy, **options
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        engine.step(x, y)

    def stats() -> dict[str, float]:
        # No engine.sync() here: it would stop parameters arriving during the next forward.
        stats = {k: float(getattr(engine.stats, k)) for k in STAT_FIELDS}
        return {**stats, "optimizer_bytes": float(engine.optimizer_bytes())}

    return Contender(spec, True, step, stats=stats, close=engine.close)


CONTENDER_KINDS: dict[str, Builder] = {"single": _build_single, "ddp": _build_ddp,
                                       "phalanx": _build_phalanx}  # fmt: skip


def build_contenders(
    specs: Sequence[ContenderSpec], make_model: Callable[[], nn.Module], ctx: Context
) -> list[Contender]:
    """One Contender per spec, each on a fresh model from ``make_model`` (same seed: same init)."""
    out = []
    for spec in specs:
        if spec.kind not in CONTENDER_KINDS:
            raise ConfigError(
                f"contender kind {spec.kind!r}; common.known: {', '.join(CONTENDER_KINDS)}"
            )
        out.append(CONTENDER_KINDS[spec.kind](spec, make_model(), ctx))
    return out


# -- the per-process benchmark ----------------------------------------------------------------
def _make_model(model: BenchModel, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS.get(model.name)()


def synthetic_batch(model: BenchModel, batch_size: int, seed: int, rank: int) -> Batch:
    """Fixed random batch of this rank: x (B, *input_shape) float32, y (B,) int64 in [0, C)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn((batch_size, *model.input_shape), generator=gen)
    y = torch.randint(0, model.num_classes, (batch_size,), generator=gen)
    return x, y


def run_block(
    ctx: Context, contender: Contender, batch: Batch, steps: int
) -> tuple[float, list[dict[str, float]]]:
    """Time ``steps`` steps between two barriers; returns (seconds, per-step stats)."""
    x, y = batch
    stats: list[dict[str, float]] = []
    active = contender.parallel or ctx.rank == 0
    ctx.barrier()
    start = time.perf_counter()
    for _ in range(steps if active else 0):
        contender.step(x, y)
        if contender.stats is not None:
            stats.append(contender.stats())
    ctx.barrier()
    return time.perf_counter() - start, stats


def _median_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in stats) for k in stats[0]} if stats else {}


def bench_model(ctx: Context, cfg: BenchConfig, model: BenchModel) -> dict[str, Any]:
    """Warm-up then ``cfg.rounds`` alternating rounds; this rank's raw numbers (rank 0 reports).

    Returns {"model", "params", "steps", "rounds": [{name: {"seconds", "stats"}}]}, where
    "stats" holds the medians over the round's steps of the contender's per-step stats.
    """
    x, y = synthetic_batch(model, cfg.batch_size, cfg.seed, ctx.rank)
    device_batch = (x.to(ctx.device), y.to(ctx.device))
    contenders = build_contenders(cfg.contenders, lambda: _make_model(model, cfg.seed), ctx)
    steps = cfg.steps_for(model)
    for contender in contenders:
        run_block(ctx, contender, device_batch, cfg.warmup)
    rounds = []
    for _ in range(cfg.rounds):
        row = {}
        for contender in contenders:
            seconds, stats = run_block(ctx, contender, device_batch, steps)
            row[contender.spec.name] = {"seconds": seconds, "stats": _median_stats(stats)}
        rounds.append(row)
    for contender in contenders:
        contender.close()
    params = sum(p.numel() for p in _make_model(model, cfg.seed).parameters())
    return {"model": model.name, "params": params, "steps": steps, "rounds": rounds}


def _worker(ctx: Context, cfg: BenchConfig) -> dict[str, Any] | None:
    """One rank: run every model; rank 0 returns the raw results."""
    torch.set_num_threads(1)  # on CUDA too (phalanx.init sets it for CPU processes)
    raw = [bench_model(ctx, cfg, BENCH_MODELS[name]) for name in cfg.models]
    env = {"backend": ctx.backend, "threads": torch.get_num_threads()}
    return {"env": env, "models": raw} if ctx.rank == 0 else None


# -- the parent: spawn, collect, summarise ----------------------------------------------------
def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Spawn ``cfg.nproc`` ranks once, run every model, return the summarised results.

    A rank's exception is raised here as WorkerError (``RankFailed``) naming the rank; a rank
    that dies stops the others, so the call never hangs on a dead peer.
    """
    from phalanx.runtime.spawn import run_ranks

    started = time.perf_counter()
    runtime = RuntimeConfig(threads=1, timeout_s=cfg.timeout_s)
    raw = run_ranks(_worker, cfg.nproc, cfg, timeout=None, runtime=runtime)[0]
    meta = common.machine_meta(
        backend=raw["env"]["backend"],
        threads_per_process=raw["env"]["threads"],
        wall_s=time.perf_counter() - started,
        config=asdict(cfg),
    )
    return {"meta": meta, "models": [summarize(m, cfg) for m in raw["models"]]}


def summarize(raw: dict[str, Any], cfg: BenchConfig) -> dict[str, Any]:
    """Per-contender per-round samples/s, medians, efficiency and ratio to the baseline."""
    steps, rounds = raw["steps"], raw["rounds"]
    specs = {s.name: s for s in cfg.contenders}
    out: dict[str, Any] = {}
    for name, spec in specs.items():
        world = 1 if spec.kind == "single" else cfg.nproc
        sps = [cfg.batch_size * world * steps / r[name]["seconds"] for r in rounds]
        out[name] = {
            "kind": spec.kind,
            "options": dict(spec.options),
            "seconds": [r[name]["seconds"] for r in rounds],
            "samples_per_s": sps,
            "median_samples_per_s": statistics.median(sps),
            "step_stats": [r[name]["stats"] for r in rounds],
            "median_step_stats": _median_stats([r[name]["stats"] for r in rounds]),
        }
    _add_relative(out, cfg.nproc)
    return {
        "model": raw["model"],
        "params": raw["params"],
        "batch_size": cfg.batch_size,
        "steps_per_round": steps,
        "warmup_steps": cfg.warmup,
        "rounds": len(rounds),
        "contenders": out,
    }


def _add_relative(out: dict[str, Any], nproc: int) -> None:
    """Efficiency vs ``nproc`` single processes, per-round ratio to DDP and, for compressed
    phalanx contenders, to DDP with its fp16 hook (the compressed baseline), where defined."""
    single = next((c for c in out.values() if c["kind"] == "single"), None)
    ddp = next((c for c in out.values() if c["kind"] == "ddp"), None)
    hook = next((c for c in out.values() if c["options"].get("fp16_hook")), None)
    for c in out.values():
        if c["kind"] == "single":
            continue
        if single is not None:
            c["efficiency"] = c["median_samples_per_s"] / (nproc * single["median_samples_per_s"])
        if ddp is not None and c is not ddp:
            c["vs_ddp"] = _ratios(c, ddp)
            c["median_vs_ddp"] = statistics.median(c["vs_ddp"])
        if hook is not None and c["options"].get("compress", "none") != "none":
            c["vs_hook"] = _ratios(c, hook)
            c["median_vs_hook"] = statistics.median(c["vs_hook"])


def _ratios(c: dict[str, Any], baseline: dict[str, Any]) -> list[float]:
    """Per-round samples/s of ``c`` over ``baseline`` (rounds alternate, so pairs are close)."""
    return [a / b for a, b in zip(c["samples_per_s"], baseline["samples_per_s"])]


# -- output -----------------------------------------------------------------------------------
def header_line(result: dict[str, Any]) -> str:
    m, c = result["meta"], result["meta"]["config"]
    return (
        f"phalanx bench exchange | {m['date']} | torch {m['torch']} | backend {m['backend']} | "
        f"nproc {c['nproc']} | threads/process {m['threads_per_process']} | "
        f"cpus {m['cpu_count']} | batch/process {c['batch_size']} | rounds {c['rounds']}"
    )


ROW_COLUMNS = ("model", "params", "contender", "samples/s", "eff", "vs ddp", "range",
               "vs fp16 hook", "exch ms/step", "MB sent/step", "MB recv/step",
               "optim MB/rank")  # fmt: skip


def _row(model: dict[str, Any], name: str, c: dict[str, Any]) -> list[str]:
    """One table row: a contender's medians on one model ('-' where not defined)."""
    stats = c["median_step_stats"]
    ratios = c.get("vs_ddp")

    def stat(key: str, scale: float, spec: str) -> str:
        return spec.format(stats[key] * scale) if key in stats else "-"

    return [
        model["model"],
        _si(model["params"]),
        name,
        f"{c['median_samples_per_s']:,.0f}",
        f"{c['efficiency']:.0%}" if "efficiency" in c else "-",
        f"{c['median_vs_ddp']:.2f}x" if "median_vs_ddp" in c else "-",
        f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-",
        _ratio_cell(c.get("vs_hook")),
        stat("exchange_s", 1e3, "{:.2f}"),
        stat("bytes_sent", 1 / 2**20, "{:.2f}"),
        stat("bytes_received", 1 / 2**20, "{:.2f}"),
        stat("optimizer_bytes", 1 / 2**20, "{:.2f}"),
    ]


def _ratio_cell(ratios: list[float] | None) -> str:
    """'1.06x(1.01-1.10)': median and range of per-round ratios, or '-'."""
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f}x({min(ratios):.2f}-{max(ratios):.2f})"


def _si(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def format_table(result: dict[str, Any]) -> str:
    """The header line and one row per (model, contender), columns common.aligned."""
    rows = [list(ROW_COLUMNS)] + [
        _row(m, name, c) for m in result["models"] for name, c in m["contenders"].items()
    ]
    return "\n".join([header_line(result), *common.aligned(rows)])


def check(result: dict[str, Any]) -> None:
    for m in result["models"]:
        for name, c in m["contenders"].items():
            if not all(math.isfinite(v) and v > 0 for v in c["samples_per_s"]):
                raise WorkerError(0, f"{m['model']}/{name}: non-finite or zero samples/s")


def add_flags(p: argparse.ArgumentParser) -> None:
    """The contenders' axes, each a comma list (``contenders_from_flags``)."""
    strategies = ", ".join(STRATEGY_CONTENDERS)
    p.add_argument("--strategies", default="allreduce",
                   help=f"comma list or 'all': {strategies} (default allreduce)")  # fmt: skip
    p.add_argument(
        "--compress", default="none", help="comma list of: none, fp16, bf16 (default none)"
    )
    p.add_argument(
        "--bucket-mb", default="25", help="comma list of sizes in MiB, 'auto' or 'single'"
    )


def contenders_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    def items(text: str) -> list[str]:
        return [n.strip() for n in text.split(",") if n.strip()]

    strategies = [s for n in items(args.strategies)
                  for s in (STRATEGY_CONTENDERS if n == "all" else [n])]  # fmt: skip
    common.known("--strategies", strategies, ("all", *STRATEGY_CONTENDERS))
    compress = items(args.compress)
    common.known("--compress", compress, ("none", "fp16", "bf16"))
    sizes = items(args.bucket_mb) or ["25"]
    for size in sizes:
        if size not in ("auto", SINGLE_BUCKET) and not _positive(size):
            raise ConfigError(f"--bucket-mb: {size!r} is not a positive size, auto or single")
    return {"contenders": strategy_contenders(list(dict.fromkeys(strategies)), compress, sizes)}


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


common.register("exchange", "phalanx Engine vs torch DDP", BenchConfig, run_benchmark,
                check, format_table, skip=("contenders",), flags=add_flags,
                from_flags=contenders_from_flags)  # fmt: skip
