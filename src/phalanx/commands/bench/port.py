"""``phalanx bench port``: its flags, and the run they start (phalanx.bench.port)."""

from __future__ import annotations

import argparse

from phalanx.bench import run_and_report
from phalanx.bench.port import (
    PortBenchConfig,
    _check,
    format_table,
    run_benchmark,
)
from phalanx.commands.bench.flags import add_config_flags, config_from_flags


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("port", help="a user's GPT script: DDP vs Engine")
    add_config_flags(p, PortBenchConfig)
    p.set_defaults(handler=cmd_port)


def cmd_port(args: argparse.Namespace) -> int:
    cfg = config_from_flags(PortBenchConfig, args)
    return run_and_report(cfg, run_benchmark, _check, format_table, args.json)
