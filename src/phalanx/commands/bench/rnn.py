"""``phalanx bench rnn``: LSTM tokens/s, 1 process vs DDP vs Engine vs WorkerPool.
Flags from the config's fields."""

from __future__ import annotations

import argparse

from phalanx.bench import run_and_report
from phalanx.bench.rnn import RnnBenchConfig, _check_finite, format_table, run_benchmark
from phalanx.commands.bench.flags import add_config_flags, config_from_flags


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("rnn", help="LSTM tokens/s: DDP, Engine, WorkerPool")
    add_config_flags(p, RnnBenchConfig)
    p.set_defaults(handler=cmd_rnn)


def cmd_rnn(args: argparse.Namespace) -> int:
    cfg = config_from_flags(RnnBenchConfig, args)
    return run_and_report(cfg, run_benchmark, _check_finite, format_table, args.json)
