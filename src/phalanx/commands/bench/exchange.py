"""``phalanx bench exchange``: its flags, and the run they start (phalanx.bench.exchange)."""

from __future__ import annotations

import argparse

from phalanx.bench import run_and_report
from phalanx.bench.exchange import (
    SINGLE_BUCKET,
    STRATEGY_CONTENDERS,
    BenchConfig,
    _check_finite,
    format_table,
    run_benchmark,
    strategy_contenders,
)
from phalanx.commands.bench.flags import add_config_flags, config_from_flags
from phalanx.errors import ConfigError


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("exchange", help="phalanx Engine vs torch DDP")
    add_config_flags(p, BenchConfig, skip=("contenders", "debug"))
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
    p.set_defaults(handler=cmd_exchange)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    contenders = strategy_contenders(
        _strategy_names(args.strategies),
        _choices(args.compress, "--compress", ("none", "fp16", "bf16")),
        _bucket_sizes(args.bucket_mb),
    )
    return config_from_flags(
        BenchConfig, args, contenders=contenders, debug=getattr(args, "debug", False)
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
    cfg = config_from_args(args)
    return run_and_report(cfg, run_benchmark, _check_finite, format_table, args.json)
