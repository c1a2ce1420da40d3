"""``phalanx bench link``: its flags, and the run they start (phalanx.bench.link)."""

from __future__ import annotations

import argparse

from phalanx.bench.link import (
    DEFAULT_REPEATS,
    LinkBenchConfig,
    _check_finite,
    format_report,
    run_benchmark,
)


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("link", help="link latency/bandwidth and threshold")
    p.add_argument("--nproc", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--json", metavar="PATH", help="write every number (every sample too) here")
    p.add_argument("--rounds", type=int, default=5, help="calibrations in a row (default 5)")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="timed allreduces per size")
    p.add_argument(
        "--models",
        default="digits_cnn,mlp",
        help="bench models to pick a threshold for (comma list; 'none' to skip)",
    )
    p.add_argument("--profile-steps", type=int, default=5, help="profiled backward steps")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="tracebacks")
    p.set_defaults(handler=cmd_link)


def config_from_args(args: argparse.Namespace) -> LinkBenchConfig:
    models = () if args.models == "none" else tuple(m.strip() for m in args.models.split(","))
    return LinkBenchConfig(
        nproc=args.nproc,
        rounds=args.rounds,
        repeats=args.repeats,
        models=tuple(m for m in models if m),
        profile_steps=args.profile_steps,
    )


def cmd_link(args: argparse.Namespace) -> int:
    from phalanx.bench import run_and_report

    cfg = config_from_args(args)
    return run_and_report(cfg, run_benchmark, _check_finite, format_report, args.json)
