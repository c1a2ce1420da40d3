"""``phalanx bench`` targets: each runs phalanx and the PyTorch baseline in one invocation."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx.fileio import atomic_write_text


def run_and_report(
    cfg: Any,
    run: Callable[[Any], dict[str, Any]],
    check: Callable[[dict[str, Any]], None],
    render: Callable[[dict[str, Any]], str],
    json_path: str | None,
) -> int:
    """The shared tail of every bench command: validate, warn when the processes outnumber
    the cores, run, check the numbers, print the table and wall time, write --json atomically.
    ``cfg`` has ``validate()`` and ``nproc``; the result has ``meta.wall_s``."""
    cfg.validate()
    cpus = os.cpu_count() or 1
    if cfg.nproc > cpus:
        print(f"note: {cfg.nproc} processes on {cpus} CPUs are oversubscribed", file=sys.stderr)
    result = run(cfg)
    check(result)
    print(render(result))
    print(f"wall time {result['meta']['wall_s']:.1f} s")
    if json_path:
        atomic_write_text(Path(json_path), json.dumps(result, indent=2) + "\n")
    return 0


def machine_meta() -> dict[str, Any]:
    """What every benchmark records about the machine it ran on."""
    import datetime
    import platform

    import torch

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }
