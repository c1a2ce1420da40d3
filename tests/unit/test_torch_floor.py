"""pyproject's torch floor (2.11, the GPU machines' torch; `make test-torch` runs the suite on
it) holds: the source calls none of the primitives newer releases added that once broke an
older floor (the fallbacks are named in the message), so the code stays portable below it."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "phalanx"
NEWER = {
    r"\breduce_scatter_single\(": "dist.reduce_scatter_tensor",
    r"\ball_gather_single\(": "dist.all_gather_into_tensor",
    r"\bgroup_src=": "src=dist.get_global_rank(group, r)",
    r"\bgroup_dst=": "dst=dist.get_global_rank(group, r)",
}


def test_no_primitive_newer_than_the_floor() -> None:
    floor = re.search(r'"torch>=([\d.]+)', (SRC.parents[1] / "pyproject.toml").read_text())
    assert floor is not None and floor.group(1) == "2.11"
    found = [
        f"{path.relative_to(SRC)}:{n}: use {fallback}"
        for path in SRC.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for pattern, fallback in NEWER.items()
        if re.search(pattern, line)
    ]
    assert found == []
