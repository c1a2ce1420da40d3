"""``phalanx bench TARGET``: every benchmark against its PyTorch baseline. Benches whose flags
are exactly their config's fields are registered here; the others have a module each."""

from __future__ import annotations

import argparse

from phalanx.bench import compile as compile_bench
from phalanx.bench import fsdp, optimizer, pipeline, planner, port, rnn, strategy_memory
from phalanx.commands.bench import data, exchange, link, memory
from phalanx.commands.bench.flags import add_plain_target


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("bench", help="benchmarks against the PyTorch baseline")
    targets = p.add_subparsers(dest="target", metavar="TARGET", required=True)
    exchange.add_parser(targets)
    add_plain_target(
        targets,
        "rnn",
        "LSTM tokens/s: DDP, Engine, WorkerPool",
        rnn.RnnBenchConfig,
        rnn.run_benchmark,
        rnn._check_finite,
        rnn.format_table,
    )
    data.add_parser(targets)
    link.add_parser(targets)
    add_plain_target(
        targets,
        "pipeline",
        "pipeline schedules vs torch.distributed.pipelining",
        pipeline.PipelineBenchConfig,
        pipeline.run_benchmark,
        pipeline._check,
        pipeline.format_report,
    )
    memory.add_parser(targets)
    add_plain_target(
        targets,
        "optimizer",
        "optimizer state in memory vs in the spill file",
        optimizer.OptimizerBenchConfig,
        optimizer.run_benchmark,
        optimizer._check,
        optimizer.format_report,
    )
    add_plain_target(
        targets,
        "port",
        "a user's GPT script: DDP vs Engine",
        port.PortBenchConfig,
        port.run_benchmark,
        port._check,
        port.format_table,
    )
    add_plain_target(
        targets,
        "strategy-memory",
        "a user's ResNet-18 script: peak RSS per rank, DDP vs each strategy",
        strategy_memory.StrategyMemoryConfig,
        strategy_memory.run_benchmark,
        strategy_memory._check,
        strategy_memory.format_table,
    )
    add_plain_target(
        targets,
        "fsdp",
        "fsdp vs torch's FSDP2 loop vs partitioned vs allreduce",
        fsdp.FsdpBenchConfig,
        fsdp.run_benchmark,
        fsdp._check,
        fsdp.format_table,
    )
    add_plain_target(
        targets,
        "compile",
        "[train] compile off vs on: phalanx train processes of the GPT config",
        compile_bench.CompileBenchConfig,
        compile_bench.run_benchmark,
        compile_bench.check,
        compile_bench.format_report,
    )
    add_plain_target(targets, "planner", "the planner's predicted step time vs measured here",
                     planner.PlannerBenchConfig, planner.run_benchmark, planner._check,
                     planner.format_report)  # fmt: skip
