"""``phalanx profile``: per-layer time and memory of a config's first steps."""

from __future__ import annotations

import argparse
from pathlib import Path

from phalanx.config import load_config


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "profile", help="per-layer time and memory of a config's first steps, on one process"
    )
    p.add_argument("config", help="TOML config")
    p.add_argument(
        "--steps",
        type=int,
        metavar="N",
        help="steps, the first a warm-up (default: 2 warm-ups, then until the steps' times "
        "are stable: at least 10, at most 50, ~15 s)",
    )
    p.add_argument("--json", metavar="FILE", help="write the profile as JSON (for the planner)")
    p.add_argument("--plot", metavar="PNG", help="memory over one step by category (viz extra)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda[:N]")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
    p.set_defaults(handler=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    from phalanx import build
    from phalanx.memory import profile as memory

    config = load_config(args.config, args.set)
    if args.plot:
        memory.require_matplotlib()  # fail before the run, not after it
    profile = build.profile_run(config, steps=args.steps, device=args.device)
    print(memory.format_profile(profile))
    if args.json:
        profile.save(Path(args.json))
        print(f"wrote {args.json}")
    if args.plot:
        memory.plot_profile(profile, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0
