"""WorkerPool: results in rank order, one process group, state between calls, functions by value,
errors with rank and remote traceback, dead and stuck workers detected, cleanup without zombies.

Starting a pool costs ~2-3 s, so one module-wide pool serves every test that leaves it usable;
each test that must break a pool starts its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest
import torch

import phalanx as px
from phalanx.runtime.pool import PoolError, RemoteTraceback, TaskError, WorkerDied

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pool():
    with px.WorkerPool(2) as p:
        yield p
    assert_reaped(p.pids)


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie has exited: not running)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def assert_reaped(pids: list[int]) -> None:
    """Each worker has exited and was reaped by us: no zombie left, no process running."""
    for pid in pids:
        with pytest.raises(ChildProcessError):  # waitpid would reap (and return) a zombie
            os.waitpid(pid, os.WNOHANG)
        assert not Path(f"/proc/{pid}").exists(), f"worker {pid} still exists"


# -- functions sent to the workers (by reference: this module is importable there) ------------
def who_am_i() -> dict:
    w = px.current_worker()
    total = torch.tensor([float(w.rank + 1)])
    torch.distributed.all_reduce(total)  # one process group across the workers
    return {"rank": w.rank, "world": w.world_size, "device": str(w.device), "pid": os.getpid(),
            "sum": float(total), "ctx_rank": w.context.rank}  # fmt: skip


def build_model(hidden: int, *, seed: int) -> int:
    torch.manual_seed(seed)
    state = px.current_worker().state
    state.model = torch.nn.Linear(4, hidden)
    state.calls = 0
    return sum(p.numel() for p in state.model.parameters())


def train_built_model(lr: float) -> torch.Tensor:
    state = px.current_worker().state
    state.calls += 1
    with torch.no_grad():
        for p in state.model.parameters():
            p -= lr
    return state.model.weight


def fail_on_rank_1(message: str) -> int:
    if px.current_worker().rank == 1:
        raise ValueError(message)
    return px.current_worker().rank


def barrier_unless_rank_1(action: str) -> None:
    """Rank 0 waits in a collective; rank 1 raises, exits or sleeps instead."""
    w = px.current_worker()
    if w.rank != 1:
        w.context.barrier()
    elif action == "raise":
        raise RuntimeError("rank 1 gave up")
    elif action == "exit":
        os._exit(7)
    else:
        time.sleep(120)


NOTEBOOK_CELL = """
import phalanx as px

class Scaler:
    def __init__(self, factor):
        self.factor = factor

    def __call__(self, x):
        return self.factor * x + px.current_worker().rank

def make_scaler(factor):
    return Scaler(factor)
"""


def notebook_module() -> types.ModuleType:
    """Code as a notebook defines it: in a module no worker can import (so sent by value)."""
    module = types.ModuleType("notebook_cell_7")
    exec(NOTEBOOK_CELL, module.__dict__)
    return module


# -- a healthy pool ---------------------------------------------------------------------------
def test_run_returns_rank_order_and_workers_share_a_process_group(pool):
    results = pool.run(who_am_i)
    assert [r["rank"] for r in results] == [0, 1] == [r["ctx_rank"] for r in results]
    assert all(r["world"] == 2 and r["sum"] == 3.0 and r["device"] == "cpu" for r in results)
    assert [r["pid"] for r in results] == pool.pids and os.getpid() not in pool.pids
    assert pool.devices == ["cpu", "cpu"] and not pool.closed
    assert pool.run_on(1, os.getpid) == pool.pids[1]


def test_state_persists_between_calls_and_run_on_reaches_one_worker(pool):
    assert pool.run(build_model, 3, seed=5) == [15, 15]
    first = pool.run(train_built_model, 0.5)
    second = pool.run(train_built_model, lr=0.25)
    torch.manual_seed(5)
    expected = torch.nn.Linear(4, 3).weight.detach()
    for weight in first:
        assert torch.allclose(weight, expected - 0.5)
    for weight in second:
        assert torch.allclose(weight, expected - 0.75)
    assert pool.run_on(1, lambda: px.current_worker().state.calls) == 2
    pool.run_on(0, lambda: setattr(px.current_worker().state, "calls", 10))
    assert pool.run(lambda: px.current_worker().state.calls) == [10, 2]


def test_notebook_functions_classes_and_closures_travel_by_value(pool):
    cell = notebook_module()
    assert cell.__name__ not in sys.modules
    assert pool.run(cell.make_scaler(10), 4) == [40, 41]
    offset = 100
    assert pool.run(lambda x: x + offset + px.current_worker().rank, 1) == [101, 102]
    scalers = pool.run(cell.make_scaler, 3)  # instances of a class only the controller defined
    assert [s.factor for s in scalers] == [3, 3] and type(scalers[0]).__name__ == "Scaler"


def test_run_each_gives_every_worker_its_own_value(pool):
    blocks = [torch.arange(4), torch.arange(4, 10)]
    assert pool.run_each(lambda block, k: int(block.sum()) * k, blocks, k=2) == [12, 78]
    with pytest.raises(PoolError, match="got 1 values for 2 workers"):
        pool.run_each(len, [[1]])


def test_exception_is_reraised_with_rank_and_remote_traceback(pool):
    with pytest.raises(TaskError) as info:
        pool.run(fail_on_rank_1, "bad shape (3, 4)")
    error = info.value
    assert error.rank == 1
    assert str(error) == "rank 1 failed: fail_on_rank_1 raised ValueError: bad shape (3, 4)"
    assert isinstance(error.exception, ValueError)
    assert isinstance(error.__cause__, RemoteTraceback)
    assert "raise ValueError(message)" in error.remote_traceback
    assert "fail_on_rank_1" in error.remote_traceback
    assert pool.run(lambda: "still usable") == ["still usable"] * 2  # the pool survives


def test_unpicklable_function_argument_or_result_is_named(pool):
    lock = threading.Lock()

    def holds_a_lock() -> bool:
        return lock.locked()

    with pytest.raises(PoolError, match=r"can't send function .*holds_a_lock to the workers"):
        pool.run(holds_a_lock)
    with pytest.raises(PoolError, match=r"argument 1 of print"):
        pool.run(print, "fine", lock)
    with pytest.raises(PoolError, match=r"argument key= of print"):
        pool.run(print, key=lock)
    with pytest.raises(TaskError, match=r"the result of .*<lambda> can.t be pickled: TypeError"):
        pool.run(lambda: threading.Lock())
    assert pool.run(len, "ab") == [2, 2]


def test_the_controller_never_initialises_cuda(pool):
    pool.run(lambda: torch.ones(3))
    assert not torch.cuda.is_initialized()


def test_bad_arguments_fail_in_one_line_before_starting_anything():
    cases = [
        (dict(num_workers=0), "num_workers: must be an int >= 1, got 0"),
        (dict(num_workers=3, device=["cpu", "cpu"]), "3 workers but only 2 devices given"),
        (dict(num_workers=2, device="cuda:1"), "2 workers but only 1 devices given (cuda:1)"),
        (dict(num_workers=1, device="gpu"), "device: got 'gpu'"),
        (dict(num_workers=1, backend="mpi"), "backend: got 'mpi'"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as info:
            px.WorkerPool(**kwargs)
        assert message in str(info.value) and "\n" not in str(info.value)


def child_pids() -> set[int]:
    """This process's children, reaped or not (a zombie is still listed until reaped)."""
    tasks = Path("/proc/self/task").iterdir()
    return {int(pid) for task in tasks for pid in (task / "children").read_text().split()}


@pytest.mark.slow  # spawns processes: not in make test-fast
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_worker_that_cannot_bind_its_device_fails_the_start_naming_the_rank():
    before = child_pids()
    with pytest.raises(TaskError, match=r"rank [01] failed: start-up: RuntimeError: .*CUDA"):
        px.WorkerPool(2, device="cuda")
    assert child_pids() == before  # every worker stopped and reaped
    assert not torch.cuda.is_initialized()


def test_run_on_checks_the_rank(pool):
    with pytest.raises(PoolError, match=r"rank 2 is not in \[0, 2\)"):
        pool.run_on(2, len, "x")


# -- broken pools -----------------------------------------------------------------------------
@pytest.mark.slow  # spawns processes: not in make test-fast
def test_worker_that_exits_is_named_and_the_others_are_stopped():
    pool = px.WorkerPool(2)
    pids = pool.pids
    with pytest.raises(WorkerDied) as info:
        pool.run(barrier_unless_rank_1, "exit")  # rank 0 waits in a barrier for rank 1
    assert info.value.rank == 1 and info.value.exit_code == 7
    assert "exit code 7" in str(info.value) and "barrier_unless_rank_1" in str(info.value)
    assert pool.closed
    assert_reaped(pids)
    with pytest.raises(PoolError, match="closed"):
        pool.run(len, "x")
    pool.close()  # idempotent


@pytest.mark.slow  # spawns processes: not in make test-fast
def test_killed_worker_is_detected_without_a_hang():
    pool = px.WorkerPool(2)
    pids = pool.pids
    killer = threading.Timer(0.5, os.kill, (pids[1], signal.SIGKILL))
    start = time.monotonic()
    killer.start()
    with pytest.raises(WorkerDied, match=r"rank 1 failed: .*signal SIGKILL") as info:
        pool.run(barrier_unless_rank_1, "sleep")  # rank 1 would sleep 120 s
    assert time.monotonic() - start < 30
    assert info.value.exit_code == -signal.SIGKILL
    assert_reaped(pids)
    pool.close()
    pool.close()


@pytest.mark.slow  # spawns processes: not in make test-fast
def test_ranks_stuck_after_a_peer_raised_are_stopped_after_the_grace_period():
    pool = px.WorkerPool(2, error_grace_s=1.0)
    pids = pool.pids
    with pytest.raises(TaskError, match=r"rank 1 failed: .*rank 1 gave up.*ranks \[0\] did not"):
        pool.run(barrier_unless_rank_1, "raise")
    assert pool.closed
    assert_reaped(pids)


CONTROLLER = """
import sys, time
import phalanx as px
pool = px.WorkerPool(int(sys.argv[2]))
print(*pool.pids, flush=True)
if sys.argv[1] == "busy":  # the test kills this controller once both workers started
    pool.run(lambda: (print("started", flush=True), time.sleep(120)))
assert pool.run(lambda: 1) == [1] * pool.num_workers
# "exit": no close(): the pool must be closed at interpreter exit
"""


@pytest.mark.slow  # spawns processes: not in make test-fast
def test_no_orphans_when_the_controller_exits_or_is_killed(tmp_path):
    script = tmp_path / "controller.py"
    script.write_text(textwrap.dedent(CONTROLLER))
    tmp_dirs = {mode: tmp_path / f"tmp-{mode}" for mode in ("exit", "busy")}
    for folder in tmp_dirs.values():
        folder.mkdir()
    procs = {
        mode: subprocess.Popen(
            [sys.executable, str(script), mode, str(workers)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "TMPDIR": str(tmp_dirs[mode])},
        )
        for mode, workers in (("exit", 1), ("busy", 1))
    }
    pids = {mode: [int(p) for p in proc.stdout.readline().split()] for mode, proc in procs.items()}
    assert len(pids["exit"]) == len(pids["busy"]) == 1
    assert procs["exit"].wait(timeout=60) == 0
    assert not any(running(pid) for pid in pids["exit"])  # closed and reaped at exit
    assert procs["busy"].stdout.readline().strip() == "[rank 0] started"  # forwarded output
    procs["busy"].kill()
    procs["busy"].wait(timeout=10)
    deadline = time.monotonic() + 15  # the workers notice their parent is gone within ~1 s
    while any(running(pid) for pid in pids["busy"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(running(pid) for pid in pids["busy"])
    # the pool's rendezvous folder is removed either way (by the workers when killed)
    assert [list(d.iterdir()) for d in tmp_dirs.values()] == [[], []]
