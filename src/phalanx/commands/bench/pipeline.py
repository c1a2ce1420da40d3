"""``phalanx bench pipeline``: pipeline schedules vs torch.distributed.pipelining.
Flags from the config's fields."""

from __future__ import annotations

import argparse

from phalanx.bench import run_and_report
from phalanx.bench.pipeline import PipelineBenchConfig, _check, format_report, run_benchmark
from phalanx.commands.bench.flags import add_config_flags, config_from_flags


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("pipeline", help="pipeline schedules vs torch.distributed.pipelining")
    add_config_flags(p, PipelineBenchConfig)
    p.set_defaults(handler=cmd_pipeline)


def cmd_pipeline(args: argparse.Namespace) -> int:
    cfg = config_from_flags(PipelineBenchConfig, args)
    return run_and_report(cfg, run_benchmark, _check, format_report, args.json)
