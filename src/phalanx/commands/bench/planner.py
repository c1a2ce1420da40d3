"""``phalanx bench planner``: its flags, and the run they start (phalanx.bench.planner)."""

from __future__ import annotations

import argparse

from phalanx.bench.planner import (
    MODELS,
    STRATEGIES,
    PlannerBenchConfig,
    _check,
    _names,
    format_report,
    run_benchmark,
)


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("planner", help="the planner's predicted step time vs measured here")
    p.add_argument(
        "--nproc", type=int, default=2, help="processes (above the cores: oversubscribed)"
    )
    p.add_argument("--models", default=",".join(MODELS), help="comma list")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma list")
    p.add_argument("--compress", default="none,fp16", help="comma list: none, fp16")
    p.add_argument("--thresholds", default="25,auto", help="comma list: MiB or auto")
    p.add_argument("--steps", type=int, default=12, help="timed (and traced) steps per block")
    p.add_argument(
        "--blocks",
        type=int,
        default=3,
        help="timed blocks per cell, alternating over the cells; a cell's error is its median "
        "block's",
    )
    p.add_argument("--json", metavar="PATH", help="write every number here")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="tracebacks")
    p.set_defaults(handler=cmd_planner)


def cmd_planner(args: argparse.Namespace) -> int:
    from phalanx.bench import run_and_report

    cfg = PlannerBenchConfig(
        nproc=args.nproc,
        models=_names(args.models),
        strategies=_names(args.strategies),
        compress=_names(args.compress),
        thresholds=_names(args.thresholds),
        steps=args.steps,
        blocks=args.blocks,
    )
    return run_and_report(cfg, run_benchmark, _check, format_report, args.json)
