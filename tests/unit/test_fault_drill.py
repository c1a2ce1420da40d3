"""tools/fault_drill.py: its pure helpers (the real drill runs take minutes and are not run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _drill():
    spec = importlib.util.spec_from_file_location("fault_drill", ROOT / "tools" / "fault_drill.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["fault_drill"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


drill = _drill()


def test_parse_environ_reads_proc_format() -> None:
    data = b"RANK=1\0WORLD_SIZE=2\0EMPTY=\0A=b=c\0junk\0\0"
    assert drill.parse_environ(data) == {"RANK": "1", "WORLD_SIZE": "2", "EMPTY": "", "A": "b=c"}
    assert drill.parse_environ(b"") == {}


def test_summarize_skips_missing_values() -> None:
    assert drill.summarize([3.0, None, 1.0, 2.0]) == {"n": 3, "median": 2.0, "min": 1.0, "max": 3.0}
    assert drill.summarize([1.0, 4.0])["median"] == 2.5
    assert drill.summarize([None, float("nan")])["n"] == 0


def test_format_time_names_the_sample_count() -> None:
    assert drill.format_time(drill.summarize([1.0, 2.0, 3.5]), 3) == "2.00 s [1.00-3.50] over 3"
    assert drill.format_time(drill.summarize([1.0, None]), 2) == "1.00 s [1.00-1.00] over 1 of 2"
    assert drill.format_time(drill.summarize([None]), 1) == "n/a (0 of 1 runs timed)"


def test_fault_time_and_lines() -> None:
    assert drill.fault_time("1700000000.125 kill forward 5 1\n") == 1700000000.125
    assert drill.fault_time("garbage\n") is None
    assert drill.last_line("a\n\nphalanx: interrupted\n  \n") == "phalanx: interrupted"
    assert drill.last_line("") == ""


def test_cells_and_counts() -> None:
    assert drill.md_cell("a | b\nc") == "a \\| b c"
    assert drill.counted([1, 1, "timeout"]) == "1 ×2, timeout ×1"
    data = bytes(range(5))
    flipped = drill.flip_middle_byte(data)
    assert flipped[2] == 2 ^ 0xFF and flipped[:2] + flipped[3:] == data[:2] + data[3:]


def test_normalize_masks_what_differs_between_repeats() -> None:
    text = "checkpoint /tmp/fd-x/s8-r2/run/a.pt bad; rank 1 failed (SIGKILL, pid 14703)"
    assert drill.normalize(text, "/tmp/fd-x") == (
        "checkpoint <tmp>/s8-r*/run/a.pt bad; rank 1 failed (SIGKILL, pid N)"
    )
