"""run_ranks (phalanx.runtime.spawn): results in rank order, a failing rank named with its remote
traceback, a rank that dies reported without a hang, no process left behind."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
import types

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime.pool import RemoteTraceback
from phalanx.runtime.spawn import RankFailed, _error_path, _failure, run_ranks


def _rank_info(ctx, offset: int) -> tuple:
    total = torch.tensor([float(ctx.rank + offset)])
    dist.all_reduce(total)
    return ctx.rank, ctx.world_size, os.environ["PHALANX_TEST_VAR"], total


def _fail_on_rank_1(ctx, how: str) -> None:
    if ctx.rank == 1:
        if how == "exit":
            os._exit(3)
        raise ValueError("boom on purpose")
    ctx.barrier()  # rank 0 would wait for rank 1 until the collective timeout


@pytest.mark.slow  # spawns processes: not in make test-fast
def test_results_in_rank_order_with_env():
    results = run_ranks(_rank_info, 2, 10, env={"PHALANX_TEST_VAR": "x"})
    assert [r[:3] for r in results] == [(0, 2, "x"), (1, 2, "x")]
    assert all(torch.equal(r[3], torch.tensor([21.0])) for r in results)
    assert not multiprocessing.active_children()


@pytest.mark.slow  # spawns processes: not in make test-fast
def test_a_raising_rank_is_named_with_its_traceback():
    with pytest.raises(RankFailed, match=r"rank 1 failed: ValueError: boom on purpose") as info:
        run_ranks(_fail_on_rank_1, 2, "raise", timeout=60)
    assert info.value.rank == 1 and isinstance(info.value.exception, ValueError)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "_fail_on_rank_1" in info.value.remote_traceback
    assert not multiprocessing.active_children()


@pytest.mark.slow  # spawns processes: not in make test-fast
def test_a_dead_rank_is_reported_and_nothing_hangs():
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 failed: process exited with exit code 3"):
        run_ranks(_fail_on_rank_1, 2, "exit", timeout=60)
    assert time.monotonic() - start < 30  # not the 60 s collective timeout of rank 0
    assert not multiprocessing.active_children()


def _fake(tmp_path, exit_codes: list, errors: dict) -> list:
    for rank, (summary, when) in errors.items():
        info = {"summary": summary, "traceback": "tb", "exception": None, "time": when}
        with open(_error_path(str(tmp_path), rank), "wb") as f:
            pickle.dump(info, f)
    return [types.SimpleNamespace(exitcode=code) for code in exit_codes]


@pytest.mark.parametrize(
    "exit_codes, errors, rank, message",
    [  # a signal first; then an own error over a lost peer; then the earliest error
        ([None, -9], {0: ("RuntimeError: Connection closed by peer", 1.0)}, 1,
         "killed by signal SIGKILL (rank 0 saw: RuntimeError: Connection closed by peer)"),
        ([1, 1], {0: ("RuntimeError: reset by peer", 1.0), 1: ("ValueError: x", 2.0)}, 1,
         "ValueError: x (ranks [0] failed too"),
        ([None, 1, 1], {1: ("ValueError: late", 2.0), 2: ("KeyError: early", 1.0)}, 2,
         "KeyError: early"),
        ([None, 3], {}, 1, "process exited with exit code 3"),
    ],
)  # fmt: skip
def test_the_cause_among_several_failures(tmp_path, exit_codes, errors, rank, message):
    error = _failure(_fake(tmp_path, exit_codes, errors), str(tmp_path))
    assert error.rank == rank and message in str(error)


def test_world_size_is_checked():
    with pytest.raises(ValueError, match="world_size: must be >= 1"):
        run_ranks(_rank_info, 0)
