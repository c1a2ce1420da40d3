"""``phalanx bench memory``: its flags, and the run they start (phalanx.bench.memory)."""

from __future__ import annotations

import argparse

from phalanx.bench.memory import (
    MemoryBenchConfig,
    _check,
    format_report,
    parse_budgets,
    run_benchmark,
)


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("memory", help="offload/recompute plan vs checkpoint, save_on_cpu")
    defaults = MemoryBenchConfig()
    p.add_argument("--rounds", type=int, default=defaults.rounds, help="rounds (default 3)")
    p.add_argument("--steps", type=int, default=defaults.steps, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed steps first")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="images per step")
    p.add_argument("--blocks", type=int, default=defaults.blocks, help="residual blocks")
    p.add_argument(
        "--peak-steps", type=int, default=defaults.peak_steps, help="steps the peak covers"
    )
    p.add_argument(
        "--budgets", default="0.75,0.5,0.3", help="phalanx budgets, fractions of the unmanaged peak"
    )
    p.add_argument("--spill-dir", default="", help="spill file directory (default: temp dir)")
    p.add_argument("--json", metavar="PATH", help="write every number here")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="tracebacks")
    p.set_defaults(handler=cmd_memory)


def cmd_memory(args: argparse.Namespace) -> int:
    from phalanx.bench import run_and_report

    cfg = MemoryBenchConfig(
        batch_size=args.batch_size,
        blocks=args.blocks,
        budgets=parse_budgets(args.budgets),
        rounds=args.rounds,
        steps=args.steps,
        warmup=args.warmup,
        peak_steps=args.peak_steps,
        spill_dir=args.spill_dir,
    )
    return run_and_report(cfg, run_benchmark, _check, format_report, args.json)
