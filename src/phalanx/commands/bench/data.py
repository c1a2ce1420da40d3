"""``phalanx bench data``: its flags, and the run they start (phalanx.bench.data)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from phalanx.bench.data import (
    DataBenchConfig,
    format_report,
    run_benchmark,
)
from phalanx.commands.bench.flags import add_config_flags, config_from_flags
from phalanx.fileio import atomic_write_text


def add_parser(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("data", help="input Pipeline vs torch DataLoader")
    add_config_flags(p, DataBenchConfig)
    p.set_defaults(handler=cmd_data)


def cmd_data(args: argparse.Namespace) -> int:
    cfg = config_from_flags(DataBenchConfig, args)
    cfg.validate()
    result = run_benchmark(cfg)
    print(format_report(result))
    print(f"wall time {result['meta']['wall_s']:.1f} s", file=sys.stderr)
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(result, indent=2) + "\n")
    return 0
