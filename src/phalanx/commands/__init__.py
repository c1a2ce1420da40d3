"""The ``phalanx`` command's verbs (the app layer), one module each: each adds its parser and
turns its arguments into calls of the library. Components below parse no arguments."""

from __future__ import annotations

import argparse

from phalanx.commands import bench, config, data, export, plan, plot, profile, train
from phalanx.commands.common import PROG

VERBS = (train, config, plot, export, profile, bench, plan, data)  # in `phalanx --help` order


def build_parser(description: str, version: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=description)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--version", action="version", version=version)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for verb in VERBS:
        verb.add_parser(commands)
    return parser
