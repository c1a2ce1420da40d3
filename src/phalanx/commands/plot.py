"""``phalanx plot``: curves of runs (PNG)."""

from __future__ import annotations

import argparse
from pathlib import Path

from phalanx.metrics import plot_runs


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("plot", help="loss, validation and throughput curves of runs (PNG)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories to compare")
    p.add_argument("-o", "--output", default="runs.png", help="PNG to write (default runs.png)")
    p.set_defaults(handler=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    plot_runs([Path(d) for d in args.run_dirs], Path(args.output))
    print(f"wrote {args.output}")
    return 0
