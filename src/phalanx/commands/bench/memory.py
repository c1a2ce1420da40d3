"""``phalanx bench memory``: the memory manager on whole ``phalanx train`` processes (none, full
recomputation, budgets); ``phalanx bench memory-layers``: in one process per measurement, the
manager vs torch's checkpoint and save_on_cpu on a conv net. Flags from the configs' fields."""

from __future__ import annotations

import argparse

from phalanx.bench import run_and_report, train_memory
from phalanx.bench.memory import (
    MemoryBenchConfig,
    _check,
    format_report,
    parse_budgets,
    run_benchmark,
)
from phalanx.commands.bench.flags import add_config_flags, config_from_flags


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser(
        "memory", help="phalanx train processes: budgets vs none and full recomputation"
    )
    add_config_flags(p, train_memory.TrainMemoryBenchConfig)
    p.set_defaults(handler=cmd_train_memory)
    p = targets.add_parser(
        "memory-layers", help="in-process: offload/recompute plan vs checkpoint, save_on_cpu"
    )
    add_config_flags(p, MemoryBenchConfig, skip=("budgets", "fresh_processes"))
    p.add_argument(
        "--budgets", default="0.75,0.5,0.3", help="phalanx budgets, fractions of the unmanaged peak"
    )
    p.set_defaults(handler=cmd_memory_layers)


def cmd_train_memory(args: argparse.Namespace) -> int:
    cfg = config_from_flags(train_memory.TrainMemoryBenchConfig, args)
    return run_and_report(
        cfg, train_memory.run_benchmark, train_memory.check, train_memory.format_report, args.json
    )


def cmd_memory_layers(args: argparse.Namespace) -> int:
    cfg = config_from_flags(MemoryBenchConfig, args, budgets=parse_budgets(args.budgets))
    return run_and_report(cfg, run_benchmark, _check, format_report, args.json)
