"""Link calibration and profile agreement on 2 Gloo ranks (one spawn, many checks).

Pass/fail never depends on speed, except a generous sanity bound on calibrate()'s duration.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from phalanx.exchange.link import (
    DEFAULT_REPEATS,
    DEFAULT_SIZES,
    LinkModel,
    calibrate,
    measure_message_s,
)
from phalanx.exchange.threshold import BackwardProfile, agree_profile, choose_bucket_bytes
from tests.helpers.spawn import run_ranks


def _calibrate_and_agree(ctx: Any, run_dir: str) -> dict[str, Any]:
    start = time.perf_counter()
    link = calibrate(ctx.group, ctx.device)
    elapsed = time.perf_counter() - start
    if ctx.rank == 0:
        link.save(run_dir)
    # Ranks observed different profiles (even different lengths); all must use rank 0's.
    mine = BackwardProfile.uniform(2**20 * (ctx.rank + 1), 4 + ctx.rank, 0.01 * (ctx.rank + 1))
    agreed = agree_profile(mine, ctx.group, ctx.device)
    # A rank without a backward (a dedicated server) contributes nothing and still agrees.
    again = agree_profile(mine if ctx.rank == 0 else None, ctx.group, ctx.device)
    assert again == agreed
    choice = choose_bucket_bytes(agreed.layer_costs(), link, ctx.world_size)
    messages = measure_message_s(ctx.group, ctx.device, repeats=20, pause_s=1e-4)
    return {
        "link": link.to_dict(),
        "messages": messages,
        "elapsed_s": elapsed,
        "profile": agreed.to_dict(),
        "choice": choice.to_dict(),
    }


def test_two_ranks_calibrate_identically(tmp_path: Path) -> None:
    results = run_ranks(_calibrate_and_agree, 2, str(tmp_path))
    first, second = results
    assert first["link"] == second["link"]  # bit-identical fits, sweeps and samples
    link = LinkModel.from_dict(first["link"])
    assert link.world_size == 2 and link.backend == "gloo"
    assert math.isfinite(link.alpha_s) and link.alpha_s > 0
    assert math.isfinite(link.beta_bytes_per_s) and link.beta_bytes_per_s > 0
    assert link.sizes == DEFAULT_SIZES
    assert all(len(s) == DEFAULT_REPEATS and min(s) > 0 for s in link.samples_s)
    assert all(r["elapsed_s"] < 5.0 for r in results)  # sanity bound, not a benchmark
    assert LinkModel.load(tmp_path) == link  # rank 0 wrote link.json
    # the message probe: rank 0's 20 one-way times on both ranks, each a real round trip
    assert first["messages"] == second["messages"] and len(first["messages"]) == 20
    assert all(0 < t < 1.0 for t in first["messages"])

    expected = BackwardProfile.uniform(2**20, 4, 0.01).to_dict()
    for r in results:
        assert r["profile"] == {**expected, "param_indices": [0, 1, 2, 3]}
    assert first["choice"] == second["choice"]
