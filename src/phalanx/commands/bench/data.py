"""``phalanx bench data``: its flags, and the run they start (phalanx.bench.data)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from phalanx.bench.data import (
    DataBenchConfig,
    format_report,
    run_benchmark,
)
from phalanx.fileio import atomic_write_text


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("data", help="input Pipeline vs torch DataLoader")
    d = DataBenchConfig()
    p.add_argument("--json", metavar="PATH", help="write every number (per round too) here")
    p.add_argument("--workers", type=int, default=d.workers, help="CPU workers of both sides")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="throughput batch")
    p.add_argument("--rounds", type=int, default=d.rounds, help="alternating throughput rounds")
    p.add_argument("--batches", type=int, default=d.batches, help="batches per block")
    p.add_argument("--train-rounds", type=int, default=d.train_rounds, help="training rounds")
    p.add_argument("--train-steps", type=int, default=d.train_steps, help="steps per block")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed batches/steps per block")
    p.add_argument("--contenders", default=",".join(d.contenders), help="comma list")
    p.add_argument("--no-train", action="store_true", help="throughput only")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="tracebacks")
    p.set_defaults(handler=cmd_data)


def cmd_data(args: argparse.Namespace) -> int:
    cfg = DataBenchConfig(
        workers=args.workers, batch_size=args.batch_size, rounds=args.rounds,
        batches=args.batches, train_rounds=args.train_rounds, train_steps=args.train_steps,
        warmup=args.warmup, train=not args.no_train,
        contenders=tuple(c.strip() for c in args.contenders.split(",") if c.strip()),
    )  # fmt: skip
    cfg.validate()
    result = run_benchmark(cfg)
    print(format_report(result))
    print(f"wall time {result['meta']['wall_s']:.1f} s", file=sys.stderr)
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(result, indent=2) + "\n")
    return 0
