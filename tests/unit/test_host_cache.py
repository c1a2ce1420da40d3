"""The host cache (memory/host_cache.py): torch's CPU allocator keeps freed blocks for reuse
and never lifts the process above its limit. It is process-wide once installed, so each check
runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from phalanx.memory import host_cache

CHECKS = textwrap.dedent(
    """
    import json
    import torch
    from phalanx.memory import host_cache, measure

    measure.release_freed_memory()  # as phalanx train with a budget: freed blocks are unmapped
    MiB = 1 << 20
    torch.ones(MiB).sum()  # the kernels' first use, before the limit is taken
    limit = measure.current_rss_bytes() + 48 * MiB
    out = {"problem": host_cache.install(limit)}
    a = torch.full((MiB // 4,), 7.0)  # 1 MiB
    address = a.data_ptr()
    del a
    b = torch.zeros(MiB // 4)
    out["reused"] = b.data_ptr() == address
    out["zeros"] = bool((b == 0).all())  # a reused block is filled as asked
    del b
    # 40 blocks of 4 MiB and a few KiB, each its own size: kept, they would hold 160 MiB
    high = 0
    for i in range(40):
        t = torch.ones(MiB + 256 * i)
        high = max(high, measure.current_rss_bytes())
        del t
    out["over_limit_mib"] = (high - limit) / MiB
    s = host_cache.stats()
    out.update(hits=s.hits, released=s.released, cached_mib=s.cached_bytes / MiB)
    print(json.dumps(out))
    """
)


def test_freed_blocks_are_reused_and_the_process_stays_under_its_limit() -> None:
    built = host_cache.library()
    if isinstance(built, str):
        pytest.skip(built)  # no C++ compiler or ninja on this machine
    run = subprocess.run(
        [sys.executable, "-c", CHECKS], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["problem"] is None
    assert out["reused"] and out["zeros"] and out["hits"] >= 1
    assert out["released"] > 0 and out["cached_mib"] < 48  # it gave blocks back to stay under
    assert out["over_limit_mib"] <= 0, out


def test_where_it_cannot_be_built_the_reason_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ninja (or no compiler): one line naming why, and the plan's note says it; the run
    then gives freed memory back to the OS as before."""
    import torch.utils.cpp_extension as cpp_extension

    from phalanx.memory import manager

    def no_ninja() -> None:
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", no_ninja)
    reason = host_cache.library.__wrapped__()
    assert isinstance(reason, str)  # the warning line's text, without its prefix
    assert reason.startswith("host cache not built (RuntimeError: Ninja is required to load C++")
    monkeypatch.setattr(host_cache, "_problem", reason)
    note = manager._host_memory_note()
    assert "goes back to the OS" in note and note.endswith(f"no host cache: {reason}")
    assert "\n" not in note
