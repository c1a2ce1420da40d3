"""``phalanx bench TARGET``: every registered benchmark (``phalanx.bench.BENCHES``), each with
the flags of its config's fields, run, checked, printed and written the same way."""

from __future__ import annotations

import argparse
import functools

from phalanx.bench import Bench, load
from phalanx.commands.bench.flags import add_config_flags, config_from_args


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("bench", help="benchmarks against the PyTorch baseline")
    targets = p.add_subparsers(dest="target", metavar="TARGET", required=True)
    benches = load()
    for name in benches:
        bench = benches.get(name)()
        target = targets.add_parser(name, help=bench.help)
        add_config_flags(target, bench.config, skip=bench.skip)
        bench.flags(target)
        target.set_defaults(handler=functools.partial(_run, bench))


def _run(bench: Bench, args: argparse.Namespace) -> int:
    return bench.report(config_from_args(bench, args), args.json)
