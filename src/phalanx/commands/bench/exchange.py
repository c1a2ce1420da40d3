"""``phalanx bench exchange``: its flags, and the run they start (phalanx.bench.exchange)."""

from __future__ import annotations

import argparse

from phalanx.bench.exchange import (
    BENCH_MODELS,
    SINGLE_BUCKET,
    STRATEGY_CONTENDERS,
    BenchConfig,
    _check_finite,
    format_table,
    run_benchmark,
    strategy_contenders,
)
from phalanx.errors import ConfigError


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("exchange", help="phalanx Engine vs torch DDP")
    p.add_argument("--nproc", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--json", metavar="PATH", help="write every number (per round too) here")
    p.add_argument("--steps", type=int, help="steps per round and contender (default: per model)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps per contender")
    p.add_argument(
        "--models", default="digits_cnn,mlp", help=f"comma list of: {', '.join(BENCH_MODELS)}"
    )
    p.add_argument("--batch-size", type=int, default=32, help="per-process batch (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and synthetic data")
    p.add_argument(
        "--strategies",
        default="allreduce",
        help=f"comma list or 'all': {', '.join(STRATEGY_CONTENDERS)} (default allreduce)",
    )
    p.add_argument(
        "--compress", default="none", help="comma list of: none, fp16, bf16 (default none)"
    )
    p.add_argument(
        "--bucket-mb", default="25", help="comma list of sizes in MiB, 'auto' or 'single'"
    )
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="tracebacks")
    p.set_defaults(handler=cmd_exchange)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        nproc=args.nproc,
        models=tuple(m.strip() for m in args.models.split(",") if m.strip()),
        steps=args.steps,
        rounds=args.rounds,
        warmup=args.warmup,
        batch_size=args.batch_size,
        seed=args.seed,
        contenders=strategy_contenders(
            _strategy_names(args.strategies),
            _choices(args.compress, "--compress", ("none", "fp16", "bf16")),
            _bucket_sizes(args.bucket_mb),
        ),
        debug=getattr(args, "debug", False),
    )


def _choices(text: str, flag: str, allowed: tuple[str, ...]) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ConfigError(
            f"{flag}: unknown {bad[0] if bad else ''!r}; allowed: {', '.join(allowed)}"
        )
    return names


def _bucket_sizes(text: str) -> list[str]:
    sizes = [n.strip() for n in text.split(",") if n.strip()]
    for size in sizes:
        if size in ("auto", SINGLE_BUCKET):
            continue
        try:
            ok = float(size) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"--bucket-mb: {size!r} is not a positive size, auto or single")
    return sizes or ["25"]


def _strategy_names(text: str) -> list[str]:
    names = list(STRATEGY_CONTENDERS) if text == "all" else [n.strip() for n in text.split(",")]
    unknown = [n for n in names if n not in STRATEGY_CONTENDERS]
    if unknown or not names:
        raise ConfigError(
            f"--strategies: unknown {unknown[0] if unknown else ''!r}; "
            f"known: all, {', '.join(STRATEGY_CONTENDERS)}"
        )
    return names


def cmd_exchange(args: argparse.Namespace) -> int:
    from phalanx.bench import run_and_report

    cfg = config_from_args(args)
    return run_and_report(cfg, run_benchmark, _check_finite, format_table, args.json)
