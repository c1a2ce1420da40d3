"""``phalanx bench rnn``: its flags, and the run they start (phalanx.bench.rnn)."""

from __future__ import annotations

import argparse

from phalanx.bench.rnn import (
    RnnBenchConfig,
    _check_finite,
    format_table,
    run_benchmark,
)


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("rnn", help="LSTM tokens/s: DDP, Engine, WorkerPool")
    d = RnnBenchConfig()
    p.add_argument("--nproc", type=int, default=d.nproc, help="worker processes (default 2)")
    p.add_argument("--json", metavar="PATH", help="write every number (per round too) here")
    p.add_argument("--steps", type=int, default=d.steps, help="steps per round and contender")
    p.add_argument("--rounds", type=int, default=d.rounds, help="alternating rounds")
    p.add_argument("--warmup", type=int, default=d.warmup, help="warm-up steps per contender")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per process")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="characters per sequence")
    p.add_argument("--embed", type=int, default=d.embed, help="embedding size")
    p.add_argument("--hidden", type=int, default=d.hidden, help="LSTM hidden size")
    p.add_argument("--seed", type=int, default=d.seed, help="weight seed")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="tracebacks")
    p.set_defaults(handler=cmd_rnn)


def config_from_args(args: argparse.Namespace) -> RnnBenchConfig:
    return RnnBenchConfig(
        nproc=args.nproc,
        embed=args.embed,
        hidden=args.hidden,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        steps=args.steps,
        rounds=args.rounds,
        warmup=args.warmup,
        seed=args.seed,
    )


def cmd_rnn(args: argparse.Namespace) -> int:
    from phalanx.bench import run_and_report

    cfg = config_from_args(args)
    return run_and_report(cfg, run_benchmark, _check_finite, format_table, args.json)
