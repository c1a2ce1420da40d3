"""``phalanx bench pipeline``: its flags, and the run they start (phalanx.bench.pipeline)."""

from __future__ import annotations

import argparse

from phalanx.bench.pipeline import (
    PipelineBenchConfig,
    _check,
    format_report,
    run_benchmark,
)
from phalanx.errors import ConfigError


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("pipeline", help="pipeline schedules vs torch.distributed.pipelining")
    p.add_argument("--nproc", type=int, default=2, help="pipeline ranks (default 2)")
    p.add_argument("--schedules", default="gpipe,1f1b,interleaved", help="comma list")
    p.add_argument("--microbatches", default="2,4,8", help="comma list of M")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--rounds", type=int, default=10, help="timed blocks per side (default 10)")
    p.add_argument("--steps", type=int, default=4, help="consecutive steps per block (default 4)")
    p.add_argument("--json", metavar="PATH", help="write every number here")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="tracebacks")
    p.set_defaults(handler=cmd_pipeline)


def cmd_pipeline(args: argparse.Namespace) -> int:
    from phalanx.bench import run_and_report

    try:
        microbatches = tuple(int(m) for m in args.microbatches.split(",") if m.strip())
    except ValueError:
        raise ConfigError(f"--microbatches: expected integers, got {args.microbatches!r}") from None
    cfg = PipelineBenchConfig(
        nproc=args.nproc,
        schedules=tuple(s.strip() for s in args.schedules.split(",") if s.strip()),
        microbatches=microbatches,
        batch_size=args.batch_size,
        rounds=args.rounds,
        steps=args.steps,
    )
    return run_and_report(cfg, run_benchmark, _check, format_report, args.json)
