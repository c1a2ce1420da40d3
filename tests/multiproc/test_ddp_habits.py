"""A DDP script's habits under every strategy, at worlds 2 and 3, in one spawned run each:
``with engine.no_sync():`` accumulation equals ``accumulate_steps`` (parameters, BatchNorm
buffers, optimizer state, the global loss) and DDP's own ``no_sync``; ``return_outputs``
gives each micro-batch's output; ``model.no_sync()`` and a DDP-wrapped model are refused in
one line; a leftover ``dist.destroy_process_group()`` on one rank while rank 0 still reads the
weights under ``ps``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import phalanx as px
from phalanx.errors import CheckpointError, ConfigError
from tests.helpers.spawn import run_ranks

STRATEGIES = ["allreduce", "tree", "partitioned", "ps", "fsdp"]
MICRO, PER_RANK, UPDATES = 3, 4, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 6 * 6, 5)
    )


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)


def _data(world: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per update: this rank's MICRO micro-batches, (MICRO, PER_RANK, ...) each."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(UPDATES):
        x = torch.randn(MICRO, world * PER_RANK, 3, 8, 8, generator=g)
        y = torch.randint(0, 5, (MICRO, world * PER_RANK), generator=g)
        part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        out.append((x[:, part], y[:, part]))
    return out


def _state(engine: px.Engine) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in engine.full_state_dict().items()}
    optimizer = engine.optimizer_state_dict()["state"]
    state.update({f"momentum {i}": s["momentum_buffer"] for i, s in optimizer.items()})
    return state


def _no_sync_run(strategy: str, data: list, ctx: Any) -> dict[str, Any]:
    model = _model()
    engine = px.Engine(model, nn.CrossEntropyLoss(), _optimizer(model), exchange=strategy,
                       return_outputs=True)  # fmt: skip
    outputs, losses = [], []
    for x, y in data:
        for i in range(MICRO):
            if i < MICRO - 1:
                with engine.no_sync():
                    loss, out = engine.step(x[i], y[i])
            else:
                loss, out = engine.step(x[i], y[i])
            assert out.shape == (PER_RANK, 5) and not out.requires_grad
            outputs.append(out)
        losses.append(engine.stats.loss)
    with pytest.raises(ConfigError, match=r"model.no_sync: .*engine.no_sync\(\)"):
        model.no_sync()
    return {"state": _state(engine), "outputs": outputs, "losses": losses}


def _accumulate_run(strategy: str, data: list) -> dict[str, Any]:
    model = _model()
    engine = px.Engine(model, nn.CrossEntropyLoss(), _optimizer(model), exchange=strategy,
                       accumulate_steps=MICRO, return_outputs=True)  # fmt: skip
    outputs, losses = [], []
    for x, y in data:
        loss, out = engine.step(x.flatten(0, 1), y.flatten(0, 1))
        assert isinstance(out, list) and len(out) == MICRO
        outputs.extend(out)
        losses.append(engine.stats.loss)
    return {"state": _state(engine), "outputs": outputs, "losses": losses}


def _ddp_run(data: list) -> dict[str, torch.Tensor]:
    """DDP's own accumulation: the loss divided by the micro-batches, no_sync but the last."""
    model = _model()
    ddp = DDP(model)
    optimizer = _optimizer(ddp)
    for x, y in data:
        for i in range(MICRO):
            with ddp.no_sync() if i < MICRO - 1 else torch.enable_grad():
                (nn.functional.cross_entropy(ddp(x[i]), y[i]) / MICRO).backward()
        optimizer.step()
        optimizer.zero_grad()
    ddp.eval()  # a validation: DDP's first forward after an update gives every rank rank 0's
    with torch.no_grad():  # buffers, which phalanx shares as the update ends
        ddp(data[0][0][0])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state.update({f"momentum {i}": s["momentum_buffer"] for i, s in enumerate(
        optimizer.state[p] for p in model.parameters())})  # fmt: skip
    return state


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-6, rtol=0,
                                   msg=lambda m, n=name: f"{what}, {n}: {m}")  # fmt: skip


def _habits(ctx: Any) -> dict[str, Any]:
    data = _data(ctx.world_size, ctx.rank)
    ddp = _ddp_run(data)
    for strategy in STRATEGIES:
        mine, accumulated = _no_sync_run(strategy, data, ctx), _accumulate_run(strategy, data)
        _close(mine["state"], accumulated["state"], f"{strategy}: no_sync vs accumulate_steps")
        _close(mine["state"], ddp, f"{strategy}: no_sync vs DDP's no_sync")
        for a, b in zip(mine["outputs"], accumulated["outputs"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        torch.testing.assert_close(mine["losses"], accumulated["losses"], atol=1e-6, rtol=0)
    wrapped = DDP(_model())
    with pytest.raises(ConfigError, match="wrapped in DistributedDataParallel.*model.module"):
        px.Engine(wrapped, nn.CrossEntropyLoss(), _optimizer(wrapped))
    return _destroy_while_rank0_reads(ctx, data)


def _destroy_while_rank0_reads(ctx: Any, data: list) -> dict[str, Any]:
    """The DDP tutorial's ending: the other ranks destroy the group right after the last step
    while rank 0 still reads and saves; every rank's last exchange completes first."""
    model = _model()
    engine = px.Engine(model, nn.CrossEntropyLoss(), _optimizer(model), exchange="ps")
    for x, y in data:
        engine.step(x[0], y[0])
    if ctx.rank != 0:
        dist.destroy_process_group()
        return {}
    state = {k: v.clone() for k, v in engine.module.state_dict().items()}
    dist.destroy_process_group()
    with pytest.raises(CheckpointError, match="gathers from every rank, and the process group is"):
        engine.optimizer_state_dict()  # its shards are on every rank: too late, in one line
    return {"read": state, "after": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_habits_under_every_strategy(world_size: int) -> None:
    results = run_ranks(_habits, world_size, timeout=240)
    _close(results[0]["read"], results[0]["after"], "ps: rank 0's read after a peer destroyed")
