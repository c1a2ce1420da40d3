"""``phalanx bench optimizer``: optimizer state in memory vs in the spill file.
Flags from the config's fields."""

from __future__ import annotations

import argparse

from phalanx.bench import run_and_report
from phalanx.bench.optimizer import OptimizerBenchConfig, _check, format_report, run_benchmark
from phalanx.commands.bench.flags import add_config_flags, config_from_flags


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("optimizer", help="optimizer state in memory vs in the spill file")
    add_config_flags(p, OptimizerBenchConfig)
    p.set_defaults(handler=cmd_optimizer)


def cmd_optimizer(args: argparse.Namespace) -> int:
    cfg = config_from_flags(OptimizerBenchConfig, args)
    return run_and_report(cfg, run_benchmark, _check, format_report, args.json)
