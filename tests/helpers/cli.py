"""The ``phalanx`` command run in this process, as the CLI tests run it: ``run_main(argv)``
(its exit code), ``assert_one_line_error`` (what a refused command prints), ``metrics``
(a run directory's records) and ``own_process_group`` (a run's world of one goes with it)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from phalanx.cli import main
from phalanx.runtime.context import shutdown


@contextlib.contextmanager
def own_process_group() -> Iterator[None]:
    """Destroy the world-of-one group a run in this process creates (only if it created it)."""
    existed = dist.is_initialized()
    try:
        yield
    finally:
        if not existed:
            shutdown()


def run_main(argv: list[str]) -> int:
    """``phalanx ARGV`` in this process; its exit code."""
    with own_process_group(), pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code


def assert_one_line_error(err: str, *fragments: str) -> str:
    """``err`` is one line, ``phalanx: error: ...`` with every fragment, no traceback; the line."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {err!r}"
    assert lines[0].startswith("phalanx: error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


def metrics(run_dir: Path) -> list[dict]:
    """The run's ``metrics.jsonl`` records, a step each."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
