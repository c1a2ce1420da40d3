"""``phalanx bench TARGET``: every benchmark against its PyTorch baseline, one module each."""

from __future__ import annotations

import argparse

from phalanx.commands.bench import (
    data,
    exchange,
    link,
    memory,
    optimizer,
    pipeline,
    planner,
    port,
    rnn,
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("bench", help="benchmarks against the PyTorch baseline")
    targets = p.add_subparsers(dest="target", metavar="TARGET", required=True)
    for target in (exchange, rnn, data, link, pipeline, memory, optimizer, port, planner):
        target.add_parser(targets)
