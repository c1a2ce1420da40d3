"""``phalanx export``: a run's weights as safetensors."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("export", help="a run's model weights as safetensors")
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory")
    p.add_argument("-o", "--output", default="model.safetensors", help="file to write")
    p.set_defaults(handler=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from phalanx.export import export_weights

    step, count = export_weights(Path(args.run_dir), Path(args.output))
    print(f"wrote {args.output}: {count} tensors from the step-{step} checkpoint")
    return 0
