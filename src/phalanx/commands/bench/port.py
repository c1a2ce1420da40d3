"""``phalanx bench port``: its flags, and the run they start (phalanx.bench.port)."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from phalanx.bench.port import (
    PortBenchConfig,
    _check,
    format_table,
    run_benchmark,
)


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("port", help="a user's GPT script: DDP vs Engine")
    d = PortBenchConfig()
    p.add_argument("--json", metavar="PATH", help="write every number (per round too) here")
    for key, value in asdict(d).items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=value,
                       help=f"default {value}")  # fmt: skip
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="tracebacks")
    p.set_defaults(handler=cmd_port)


def cmd_port(args: argparse.Namespace) -> int:
    from phalanx.bench import run_and_report

    cfg = PortBenchConfig(**{k: getattr(args, k) for k in asdict(PortBenchConfig())})
    return run_and_report(cfg, run_benchmark, _check, format_table, args.json)
