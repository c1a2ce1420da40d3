"""``phalanx bench planner``: its flags, and the run they start (phalanx.bench.planner)."""

from __future__ import annotations

import argparse

from phalanx.bench import run_and_report
from phalanx.bench.planner import (
    PlannerBenchConfig,
    _check,
    format_report,
    run_benchmark,
)
from phalanx.commands.bench.flags import add_config_flags, config_from_flags


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("planner", help="the planner's predicted step time vs measured here")
    add_config_flags(p, PlannerBenchConfig)
    p.set_defaults(handler=cmd_planner)


def cmd_planner(args: argparse.Namespace) -> int:
    cfg = config_from_flags(PlannerBenchConfig, args)
    return run_and_report(cfg, run_benchmark, _check, format_report, args.json)
