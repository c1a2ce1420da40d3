"""What every verb of the ``phalanx`` command shares: its name, exit codes, common flags."""

from __future__ import annotations

import argparse

PROG = "phalanx"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
EXIT_PREEMPTED = 143  # 128 + SIGTERM


def add_debug(p: argparse.ArgumentParser) -> None:
    """``--debug`` after the verb too (``phalanx train --debug``): show tracebacks."""
    p.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )


def add_set(p: argparse.ArgumentParser) -> None:
    """``--set SECTION.KEY=VALUE`` (repeatable): override one config value."""
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
