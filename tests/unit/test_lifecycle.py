"""Engine lifecycle in a world of one: close() is optional and idempotent, ``with`` works,
shutdown closes what is still open, the optimizer object survives bucket rebuilds."""

from __future__ import annotations

import functools
import gc
import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phalanx as px
from tests.helpers.models import Reversed, batch

SGD = functools.partial(torch.optim.SGD, lr=0.1)


def _comm_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("phalanx-comm")]


pytestmark = pytest.mark.usefixtures("fresh_world")  # no world of one before or after


@pytest.mark.parametrize("strategy", ["allreduce", "tree", "partitioned", "ps"])
def test_with_block_and_repeated_close(strategy: str) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with px.Engine(model, nn.functional.cross_entropy, SGD, exchange=strategy) as engine:
        engine.step(*batch())
    assert _comm_threads() == []
    engine.close()  # idempotent
    before = [p.detach().clone() for p in model.parameters()]
    model(batch()[0]).sum().backward()  # the model works without the engine: no hooks left
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_shutdown_closes_open_engines_before_the_group() -> None:
    engines = [
        px.Engine(nn.Linear(4, 3), nn.functional.cross_entropy, SGD, exchange=name)
        for name in ("partitioned", "ps", "tree")
    ]
    for engine in engines:
        engine.step(*batch())
    assert len(_comm_threads()) == 3
    px.shutdown()
    assert _comm_threads() == [] and not dist.is_initialized()
    assert all(engine._teardown.closed for engine in engines)


@pytest.mark.parametrize("strategy", ["allreduce", "partitioned", "ps"])
def test_optimizer_object_survives_rebuilds_and_scheduler_acts(strategy: str) -> None:
    """Buckets rebuild after step 1 (the observed order differs: layers registered in
    reverse) and at every bucket_mb='auto' trial; the optimizer stays the same object."""

    engine = px.Engine(Reversed(), nn.functional.cross_entropy, SGD, exchange=strategy,
                       bucket_mb="auto", first_bucket_mb=0.0001)  # fmt: skip
    optimizer = engine.optimizer
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    steps = 0
    while not engine.auto.done or steps < 3:
        engine.step(*batch())
        scheduler.step()
        steps += 1
        assert engine.optimizer is optimizer
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**steps)


@pytest.mark.parametrize("strategy", ["allreduce", "partitioned"])
def test_a_rebuild_leaves_no_holder_with_the_closed_strategy(strategy: str) -> None:
    """Reversed registers its layers in reverse, so the buckets rebuild after step 1 and a new
    strategy replaces the first: every part of the Engine reads it through the one slot, and
    none of them still refers to the strategy the rebuild closed."""
    engine = px.Engine(Reversed(), nn.functional.cross_entropy, SGD, exchange=strategy)
    first = engine.strategy
    for _ in range(2):
        engine.step(*batch())
    assert engine.strategy is not first and engine.slot.current is engine.strategy
    launch = engine.buckets.launch
    holders = [launch.__self__, engine.trace.slot, engine._teardown.parts[0], engine.state.slot]
    assert all(holder is engine.slot for holder in holders)
    parts = [engine, engine.buckets, engine.trace, engine.slot, engine.state, engine._teardown]
    held = {id(vars(part)) for part in parts} | {id(engine._teardown.parts)}
    assert not [r for r in gc.get_referrers(first) if id(r) in held]
    engine.close()


def _os_threads() -> set[str]:
    """This process's Gloo threads (named ``gloo_tcp_loop`` and ``pt_gloo_runloop``): other
    threads come and go with whatever ran before in this process (torch's intra-op pool starts
    at its first parallel op; pytest-xdist's own threads)."""
    threads = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            if "gloo" in (task / "comm").read_text():
                threads.add(task.name)
        except FileNotFoundError:  # ended meanwhile
            continue
    return threads


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_shutdown_joins_the_backends_worker_threads() -> None:
    """After shutdown no Gloo worker thread is left to drop a Work during interpreter
    finalization (the exit abort; docs/reliability.md), even with the user's ctx kept."""
    before = _os_threads()
    ctx = px.init()
    engine = px.Engine(nn.Linear(4, 3), nn.functional.cross_entropy, SGD)
    for _ in range(2):
        engine.step(*batch())
    assert _os_threads() - before  # Gloo's worker and transport threads
    px.shutdown()
    assert ctx.group is None  # the user's Context no longer keeps the group alive
    assert _os_threads() - before == set()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_shutdown_joins_a_group_captured_as_a_default_argument() -> None:
    """A module evaluating ``def f(group=dist.group.WORLD)`` after init (as
    torch.distributed.nn.functional does when torch._dynamo first imports it) must not keep
    the group's worker threads alive into interpreter finalization."""
    before = _os_threads()
    px.init()
    captures = types.ModuleType("phalanx_test_captures")
    world = "dist.group.WORLD"
    source = f"import torch.distributed as dist\ndef f(x, group={world}, *, g={world}): pass"
    exec(source, captures.__dict__)
    sys.modules[captures.__name__] = captures
    try:
        assert captures.f.__defaults__[0] is not None
        px.shutdown()
        assert _os_threads() - before == set()
        assert captures.f.__defaults__ == (None,) and captures.f.__kwdefaults__ == {"g": None}
    finally:
        del sys.modules[captures.__name__]


@pytest.mark.slow  # spawns processes or trains for real: not in make test-fast
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_shutdown_after_torch_captured_the_world_group_leaves_no_thread() -> None:
    """The real trigger, in a fresh interpreter: the first optimizer after init imports
    torch._dynamo, which imports torch.distributed.nn.functional, whose defaults capture the
    world group; shutdown still joins every Gloo thread."""
    script = (
        "import os, torch, phalanx as px\n"
        "before = set(os.listdir('/proc/self/task'))\n"
        "px.init()\n"
        "torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)\n"
        "import torch.distributed.nn.functional as F\n"
        "assert F.broadcast.__defaults__[0] is not None\n"
        "px.shutdown()\n"
        "print(sorted(set(os.listdir('/proc/self/task')) - before))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.parametrize("strategy", ["partitioned", "ps"])
def test_a_dropped_engine_closes_itself(strategy: str) -> None:
    """A script that returns from main() right after its last step: the Engine's pending
    send-back completes and its thread stops when the Engine goes, not at exit."""

    def main() -> nn.Module:
        model = nn.Linear(4, 3)
        engine = px.Engine(model, nn.functional.cross_entropy, SGD, exchange=strategy)
        engine.step(*batch())
        return model

    model = main()
    assert _comm_threads() == []
    model(batch()[0]).sum().backward()  # no hooks left on the user's model
