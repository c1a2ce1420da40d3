"""``phalanx config show``: a config with every default filled in."""

from __future__ import annotations

import argparse
import json

from phalanx.config import load_config


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("config", help="inspect configs")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="print a config with every default filled in")
    show.add_argument("config", help="TOML config")
    show.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    show.set_defaults(handler=cmd_config_show)


def cmd_config_show(args: argparse.Namespace) -> int:
    print(json.dumps(load_config(args.config, args.set).to_dict(), indent=2))
    return 0
