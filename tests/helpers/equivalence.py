"""The "N ranks equal one process" harness of the multi-process tests.

Every rank of a spawned world builds the same global batches (``global_batches``), trains an
Engine (``make_engine``) on its own rows of each (``train_shards``: data rank r steps on rows
``[r * local_batch, (r + 1) * local_batch)``), and compares it with plain torch trained in this
process on the whole global batch (``one_process``): the mean of the ranks' gradients is the
gradient of the global batch's mean loss. ``copy_params``, ``copy_state``, ``max_diff`` and
``assert_states_close`` compare the two. ``ReversedNet``, ``SGD`` and ``ADAM`` are the model
and optimizers most of them use.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import phalanx as px
from phalanx.exchange import strategy_factory
from phalanx.memory.manager import MemoryConfig, MemoryManager

LOCAL_BATCH = 8
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=0.01)

Batches = list[tuple[torch.Tensor, torch.Tensor]]


class ReversedNet(nn.Module):
    """Layers registered in the reverse of their use, so backward order != reverse registration
    and the Engine must rebuild its buckets from the observed order. 20 features, 10 classes:
    ``global_batches``' defaults."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(32, 10)
        self.mid = nn.Linear(64, 32)
        self.stem = nn.Linear(20, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(torch.relu(self.stem(x)))))


def global_batches(
    world: int,
    *,
    steps: int = 6,
    features: int | Sequence[int] = 20,
    classes: int = 10,
    local_batch: int = LOCAL_BATCH,
    seed: int = 0,
) -> Batches:
    """``steps`` global batches of ``local_batch * world`` rows: standard normal inputs of
    ``features`` (a size or a shape) and integer labels below ``classes``, from one seeded
    generator, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    n = local_batch * world
    shape = (features,) if isinstance(features, int) else tuple(features)
    return [
        (torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g))
        for _ in range(steps)
    ]


def host_memory(ctx: px.Context, place: str, chunk_mb: float) -> MemoryManager | None:
    """The optimizer state in a spill file (``"stream"``) or stepped on the host (``"mirror"``)
    in chunks of ``chunk_mb`` (F19); ``""``: None, the state where the strategy keeps it."""
    if not place:
        return None
    return MemoryManager.build([], MemoryConfig(optimizer=place, optimizer_chunk_mb=chunk_mb),
                               ctx.device)  # fmt: skip


def make_engine(
    ctx: px.Context,
    model: nn.Module,
    optimizer: Any,
    strategy: str | None = None,
    options: dict | None = None,
    *,
    loss: Callable[..., torch.Tensor] = nn.functional.cross_entropy,
    **kwargs: Any,
) -> px.Engine:
    """An Engine on a copy of ``model`` (the caller's stays as it was, for the reference) with
    ``loss``, ``optimizer`` (a factory), the registered ``strategy`` with its ``options``
    (None: ``kwargs``' ``exchange`` or the default) and the other Engine arguments as given."""
    if strategy is not None:
        kwargs["exchange"] = strategy_factory(strategy, options)
    return px.Engine(copy.deepcopy(model), loss, optimizer, context=ctx, **kwargs)


def shard(t: torch.Tensor, rank: int, local_batch: int = LOCAL_BATCH) -> torch.Tensor:
    """Data rank ``rank``'s rows of a global batch."""
    return t[rank * local_batch : (rank + 1) * local_batch]


def train_shards(
    engine: px.Engine,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    local_batch: int | None = LOCAL_BATCH,
    sync: bool = True,
    observe: Callable[[px.Engine], Any] | None = None,
) -> list:
    """Step ``engine`` on this data rank's ``local_batch`` rows of each global batch (None:
    the batches are this rank's own, each stepped whole), then ``engine.sync()`` unless
    ``sync`` is False (reading ``engine.module`` waits by itself: a test that relies on that
    leaves it out). ``observe(engine)`` after every step: what it returned, a step each."""
    r = engine.data_rank
    seen = []
    for x, y in batches:
        if local_batch is None:
            engine.step(x, y)
        else:
            engine.step(shard(x, r, local_batch), shard(y, r, local_batch))
        if observe is not None:
            seen.append(observe(engine))
    if sync:
        engine.sync()
    return seen


@dataclass
class OneProcess:
    """What ``one_process`` trained: the model, its optimizer, the gradient norms before
    clipping (a step each; empty without clipping)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    grad_norms: list[float] = field(default_factory=list)

    def state(self) -> dict[str, torch.Tensor]:
        """A copy of the model's state dict."""
        return {k: v.clone() for k, v in self.model.state_dict().items()}


def one_process(
    model: nn.Module,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    accumulate: int = 1,
    skip: Collection[int] = (),
    max_grad_norm: float | None = None,
    autocast: torch.dtype | None = None,
    loss_scale: float = 1.0,
) -> OneProcess:
    """Plain single-process training on the global batches, with cross entropy: a copy of
    ``model``, ``optimizer``'s optimizer over its trainable parameters. Each batch in
    ``accumulate`` chunks, each chunk's loss divided by ``accumulate`` (chunks as the ranks'
    rows: a branch runs exactly where it ran on that rank); the steps in ``skip`` left out (no
    update, no optimizer step count); the gradients clipped to ``max_grad_norm``; the forward
    under CPU autocast to ``autocast``, the loss multiplied by ``loss_scale`` and the gradients
    divided by it again (exactly, for a power of two) before clipping and the step."""
    model = copy.deepcopy(model)
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    norms: list[float] = []
    for step, (x, y) in enumerate(batches):
        if step in skip:
            continue
        opt.zero_grad(set_to_none=True)
        for xc, yc in zip(torch.chunk(x, accumulate), torch.chunk(y, accumulate)):
            with contextlib.nullcontext() if autocast is None else torch.autocast("cpu", autocast):
                loss = nn.functional.cross_entropy(model(xc), yc)
            loss = loss / accumulate
            if loss_scale != 1.0:
                loss = loss * loss_scale
            loss.backward()
        if loss_scale != 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(1.0 / loss_scale)
        if max_grad_norm is not None:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        opt.step()
    return OneProcess(model, opt, norms)


def copy_params(module: nn.Module) -> list[torch.Tensor]:
    """Copies of ``module``'s parameters, in order (an Engine's: ``engine.module``)."""
    return [p.detach().clone() for p in module.parameters()]


def copy_state(engine: px.Engine) -> dict[str, torch.Tensor]:
    """A copy of the Engine's whole state dict (``full_state_dict``: a collective under
    fsdp, so every rank calls it)."""
    return {k: v.detach().clone() for k, v in engine.full_state_dict().items()}


def max_diff(got: Any, want: Any) -> float:
    """The largest absolute difference: between two state dicts (over ``got``'s keys), or two
    models' parameters in order (each a module or a list of tensors)."""
    if isinstance(got, dict):
        return max((v - want[k]).abs().max().item() for k, v in got.items())
    a = got.parameters() if isinstance(got, nn.Module) else got
    b = want.parameters() if isinstance(want, nn.Module) else want
    return max((p.detach() - q.detach()).abs().max().item() for p, q in zip(a, b))


def assert_states_close(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    *,
    atol: float,
    rtol: float,
    what: str = "",
) -> None:
    """Every entry of ``want`` is in ``got`` and close to it (``torch.testing.assert_close``),
    a mismatch named by ``what`` and its key."""
    for name, value in want.items():
        torch.testing.assert_close(
            got[name], value, atol=atol, rtol=rtol,
            msg=lambda m, n=name: f"{what} {n}: {m}".lstrip(),
        )  # fmt: skip
