"""Misuse of the Python API ends in one phalanx error line that names the argument and the fix,
as CLI mistakes do (issue 24, deliverable 5); nothing is silently ignored."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx import checkpoint
from phalanx.errors import PhalanxError

SGD = functools.partial(torch.optim.SGD, lr=0.1)
CE = nn.functional.cross_entropy


def _engine(**options: Any) -> px.Engine:
    model = options.pop("model", None) or nn.Linear(3, 2)
    return px.Engine(model, options.pop("loss_fn", CE), options.pop("optimizer", SGD), **options)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 3), torch.randint(0, 2, (4,))


@pytest.fixture(autouse=True)
def _no_world_left():
    """An Engine refused after it joined the implicit world of one leaves that world: close it,
    so later tests in this process start from none."""
    yield
    px.shutdown()


CONSTRUCTION = {
    "model": (dict(model=lambda x: x), "model: pass a torch.nn.Module"),
    "optimizer kind": (dict(optimizer="adam"), "optimizer: pass a torch.optim.Optimizer"),
    "loss_fn": (dict(loss_fn=3), "loss_fn: pass a function"),
    "loss_fn class": (
        dict(loss_fn=nn.CrossEntropyLoss),
        "loss_fn: pass an instance, CrossEntropyLoss(), not the class CrossEntropyLoss",
    ),
    "exchange": (dict(exchange="allredcue"), "unknown exchange strategy 'allredcue'"),
    "compress": (dict(compress="fp61"), "unknown compression 'fp61'"),
    "bucket_mb": (dict(bucket_mb="big"), "bucket_mb: got 'big'"),
    "precision": (dict(precision="fp17"), "precision: got 'fp17'"),
    "accumulate_steps": (dict(accumulate_steps=0), "accumulate_steps: must be >= 1"),
    "max_grad_norm kind": (dict(max_grad_norm="1"), "max_grad_norm: expected float"),
    "max_grad_norm value": (dict(max_grad_norm=-1.0), "max_grad_norm: must be >= 0"),
    "unknown keyword": (dict(bucket_size=4), "bucket_size: not an Engine argument; allowed:"),
    "step kind": (
        dict(step={"precision": "bf16"}),
        "step: pass a phalanx.engine.config.StepConfig",
    ),
    "exchange kind": (dict(exchange=3), "exchange: pass a strategy name"),
    "memory": (dict(memory="16GB"), "memory: pass a phalanx.memory.manager.MemoryManager"),
    "trace": (dict(trace=True), "trace: pass a phalanx.engine.tracing.TraceConfig"),
    "parallel": (dict(parallel={"pipeline": 2}), "parallel: pass a phalanx.parallel.layout"),
    "context": (dict(context="world"), "context: pass the Context of phalanx.init()"),
    "DataParallel": (
        dict(model=nn.DataParallel(nn.Linear(3, 2))),
        "model: it is wrapped in DataParallel, which would exchange the gradients again; pass "
        "the model itself (model.module)",
    ),
    "sparse embedding": (
        dict(model=nn.Sequential(nn.EmbeddingBag(9, 3, sparse=True), nn.Linear(3, 2))),
        "model: 0 (EmbeddingBag) has sparse=True, whose sparse gradients phalanx does not",
    ),
}


def _one_line(error: BaseException, expected: str) -> None:
    message = str(error)
    assert isinstance(error, PhalanxError), f"{type(error).__name__}: {message}"
    assert "\n" not in message and expected in message, message


@pytest.mark.parametrize("case", sorted(CONSTRUCTION))
def test_wrong_engine_arguments_are_one_line(case: str) -> None:
    options, expected = CONSTRUCTION[case]
    with pytest.raises(PhalanxError) as raised:
        _engine(**options)
    _one_line(raised.value, expected)


def _other_model_state() -> dict[str, Any]:
    with _engine(model=nn.Linear(4, 2)) as other:
        return other.state_dict()


def _misuse_cases(tmp_path: Path) -> dict[str, tuple[Callable[[px.Engine], Any], str]]:
    return {
        "step without targets": (lambda e: e.step(torch.randn(4, 3)), "call step(inputs, targets)"),
        "step after close": (lambda e: (e.close(), e.step(*_batch())), "this Engine is closed"),
        "uneven accumulation": (
            lambda e: _engine(accumulate_steps=3).step(*_batch()),
            "does not split into accumulate_steps=3",
        ),
        "state of another kind": (lambda e: e.load_state_dict({"foo": 1}), "got ['foo']"),
        "state of another model": (
            lambda e: e.load_state_dict(_other_model_state()),
            "'weight' has shape (2, 4) in the state and (2, 3) in the model",
        ),
        "state missing a tensor": (
            lambda e: e.load_state_dict({**e.state_dict(), "model": {}}),
            "lacks 'bias'",
        ),
        "checkpoint of an Engine, not a dict": (
            lambda e: checkpoint.save(tmp_path, 1, e),
            "state: pass a dict of name -> object",
        ),
        "restore into a list": (
            lambda e: checkpoint.restore(tmp_path, [e]),
            "state: pass a dict of name -> object",
        ),
        "model.no_sync of a ported DDP loop": (
            lambda e: e.local_module.no_sync(),
            "model.no_sync: the model is not wrapped in DDP; use `with engine.no_sync():`",
        ),
        "model that returns logits": (
            lambda e: _engine(loss_fn=None).step(torch.randn(4, 3)),
            "loss_fn is None, so the model's output must be its loss",
        ),
    }


def test_misusing_an_engine_is_one_line(tmp_path: Path) -> None:
    for case, (misuse, expected) in _misuse_cases(tmp_path).items():
        engine = _engine()
        try:
            with pytest.raises(PhalanxError) as raised:
                misuse(engine)
            _one_line(raised.value, expected)
        except AssertionError as e:
            raise AssertionError(f"{case}: {e}") from None
        finally:
            engine.close()


def test_a_state_from_the_same_model_still_loads() -> None:
    """The checks refuse only what is wrong: a state of the same model loads, in place."""
    source, target = _engine(), _engine()
    source.step(*_batch())
    target.load_state_dict(source.state_dict())
    for a, b in zip(source.module.parameters(), target.module.parameters()):
        torch.testing.assert_close(a, b)
    source.close()
    target.close()


class _SparseGradient(torch.autograd.Function):
    """The identity whose backward returns a sparse gradient (as a custom layer might)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:
        return w.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.to_sparse()


class _SparseLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ _SparseGradient.apply(self.w)


def test_a_sparse_gradient_from_elsewhere_is_one_line() -> None:
    """Sparse Embeddings are refused when the Engine is built; any other layer whose gradient
    arrives sparse is refused at its first backward (it used to end in "Cannot access data
    pointer of Tensor that doesn't have storage" from inside the buckets)."""
    engine = _engine(model=_SparseLayer())
    with pytest.raises(PhalanxError) as error:
        engine.step(*_batch())
    _one_line(error.value, "got a torch.sparse_coo gradient; phalanx exchanges dense gradients")
    engine.close()


@pytest.mark.parametrize("strategy", ["allreduce", "partitioned", "ps"])
def test_a_leftover_optimizer_step_is_one_line(strategy: str) -> None:
    """A loop ported from DDP that still calls ``optimizer.step()`` after ``engine.step()``
    updated every parameter twice, with no word (under ``partitioned``/``ps`` only this rank's
    shards); refused while the Engine is open, the script's own again after ``close()``."""
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = px.Engine(model, CE, optimizer, exchange=strategy)
    engine.step(*_batch())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PhalanxError) as error:
        optimizer.step()
    _one_line(error.value, "SGD.step() called outside engine.step(): the Engine steps the")
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # no update
    engine.step(*_batch())  # the Engine's own steps go on
    engine.close()
    optimizer.step()
