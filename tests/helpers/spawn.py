"""Spawn harness: run a function in ``world_size`` Gloo ranks and collect per-rank results.

Ranks rendezvous through a file (no ports, so no races between tests). A rank's exception is
re-raised in the caller as RankFailed naming the rank, with the remote traceback; a rank that
dies or a run that exceeds ``timeout`` stops every rank, so a broken test never hangs.
"""

from __future__ import annotations

import io
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


class RankFailed(AssertionError):
    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0
) -> list[Any]:
    """``fn(ctx, *args)`` in each rank (ctx: phalanx Context); returns results in rank order."""
    spawn = mp.get_context("spawn")
    results: mp.Queue = spawn.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [
            spawn.Process(
                target=_entry, args=(fn, rank, world_size, init_method, results, args), daemon=True
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join(timeout=10)


def _collect(procs: list, results: mp.Queue, world_size: int, timeout: float) -> list[Any]:
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(collected) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            _check_alive(procs, collected, deadline, timeout)
            continue
        if not ok:
            raise RankFailed(rank, payload)
        collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return [collected[r] for r in range(world_size)]


def _check_alive(procs: list, collected: dict, deadline: float, timeout: float) -> None:
    for rank, p in enumerate(procs):
        if rank not in collected and not p.is_alive() and p.exitcode not in (0, None):
            raise RankFailed(rank, f"process died with exit code {p.exitcode}")
    if time.monotonic() > deadline:
        raise TimeoutError(f"ranks did not finish within {timeout} s")


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_method: str,
    results: mp.Queue,
    args: tuple,
) -> None:
    import phalanx
    from phalanx.runtime.context import RuntimeConfig

    try:
        ctx = phalanx.init(
            RuntimeConfig(threads=1, timeout_s=60),
            init_method=init_method,
            rank=rank,
            world_size=world_size,
        )
        result = fn(ctx, *args)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        phalanx.shutdown()
