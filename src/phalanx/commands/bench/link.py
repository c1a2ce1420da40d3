"""``phalanx bench link``: its flags, and the run they start (phalanx.bench.link)."""

from __future__ import annotations

import argparse

from phalanx.bench import run_and_report
from phalanx.bench.link import (
    LinkBenchConfig,
    _check_finite,
    format_report,
    run_benchmark,
)
from phalanx.commands.bench.flags import add_config_flags, config_from_flags


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("link", help="link latency/bandwidth and threshold")
    add_config_flags(p, LinkBenchConfig, skip=("sizes", "models"))
    p.add_argument(
        "--models",
        default="digits_cnn,mlp",
        help="bench models to pick a threshold for (comma list; 'none' to skip)",
    )
    p.set_defaults(handler=cmd_link)


def config_from_args(args: argparse.Namespace) -> LinkBenchConfig:
    models = () if args.models == "none" else tuple(m.strip() for m in args.models.split(","))
    return config_from_flags(LinkBenchConfig, args, models=tuple(m for m in models if m))


def cmd_link(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    return run_and_report(cfg, run_benchmark, _check_finite, format_report, args.json)
