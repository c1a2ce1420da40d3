"""``phalanx bench optimizer``: its flags, and the run they start (phalanx.bench.optimizer)."""

from __future__ import annotations

import argparse

from phalanx.bench.optimizer import (
    OptimizerBenchConfig,
    _check,
    format_report,
    run_benchmark,
)


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("optimizer", help="optimizer state in memory vs in the spill file")
    p.add_argument("--width", type=int, default=1536, help="features per layer")
    p.add_argument("--layers", type=int, default=12, help="square Linear layers")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--chunk-mb", type=float, default=16.0, help="state per streamed chunk, MiB")
    p.add_argument("--rounds", type=int, default=3, help="fresh-process rounds per variant")
    p.add_argument("--steps", type=int, default=4, help="timed steps per process")
    p.add_argument("--spill-dir", default="", help="directory of the spill file")
    p.add_argument("--json", metavar="PATH", help="write every number here")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="tracebacks")
    p.set_defaults(handler=cmd_optimizer)


def cmd_optimizer(args: argparse.Namespace) -> int:
    from phalanx.bench import run_and_report

    cfg = OptimizerBenchConfig(
        width=args.width,
        layers=args.layers,
        batch_size=args.batch_size,
        chunk_mb=args.chunk_mb,
        rounds=args.rounds,
        steps=args.steps,
        spill_dir=args.spill_dir,
    )
    return run_and_report(cfg, run_benchmark, _check, format_report, args.json)
