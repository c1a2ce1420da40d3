"""``fsdp``: parameters, gradients and optimizer state sharded over the data ranks, through
torch's ``fully_shard`` (FSDP2), as one more exchange strategy.

Units: each top-level child module holding parameters (a config model's layers), or the
submodules whose class is named in ``units``; a unit holding a parameter it shares with
another (tied embedding and head) stays in the root unit, which holds everything else. Each
parameter becomes a DTensor sharded on dim 0 (rows; torch.chunk's split, the last rank's
shard may be shorter or empty). In the Engine's step (phalanx.engine; the same phases):
  Phase 1 (``begin_step``): gradients cleared; the last read's full copy dropped.
  Phase 2: forward all-gathers each unit before it runs (``prefetch`` units ahead); backward
    all-gathers it again (``reshard_after_forward``) and reduce-scatters its gradient to the
    shards as soon as it is ready, overlapping the next unit's backward. Only the last
    micro-batch's backward reduce-scatters (``before_backward``); earlier ones accumulate.
  Phase 4 (``finish`` / ``inspect_gradients``): the reduce-scatters ended with backward;
    the verdict, the clipping norm and the step's global loss share one all-reduce.
  Phase 5 (``update``): the optimizer steps this rank's shards (1/P of every tensor).

The Engine builds no gradient buckets for it (``shards_parameters``). Reads of the whole
model (``Engine.module``) gather it into a plain copy of the module (a collective, see
``read_module``); checkpoints hold each rank's rows of every tensor, so they resume under
any strategy and world size.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.errors import ConfigError
from phalanx.exchange.base import STRATEGIES, Strategy, StrategyParts, holds_nonfinite
from phalanx.exchange.buckets import Bucket
from phalanx.fields import option, require
from phalanx.runtime.context import Context

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True)
class FsdpConfig:
    """``[exchange] options`` of ``fsdp``."""

    reshard_after_forward: bool = option(
        True,
        "free each unit's gathered parameters after its forward and gather them again for "
        "backward (less memory, one more all-gather per unit)",
    )
    prefetch: int = option(
        1, "units whose all-gather is issued ahead of the running one, in forward and backward"
    )
    param_dtype: str | None = option(
        None, "dtype of the gathered parameters for compute: float32, bfloat16, float16 or None"
    )
    reduce_dtype: str | None = option(
        None, "dtype gradients are reduce-scattered in (None: param_dtype's, else float32)"
    )
    units: list[str] = option(
        factory=list,
        doc="class names of the submodules that become units (empty: each top-level child "
        "module with parameters, i.e. a config model's layers)",
    )

    def __post_init__(self) -> None:
        require(self.prefetch >= 0, "prefetch", f"must be >= 0, got {self.prefetch}")
        for key in ("param_dtype", "reduce_dtype"):
            value = getattr(self, key)
            require(
                value is None or value in DTYPES,
                key,
                f"got {value!r}; allowed: {', '.join(DTYPES)} or None",
            )


@STRATEGIES.register("fsdp")
class FullyShardedStrategy(Strategy):
    """Sharded parameters, gradients and state through ``fully_shard`` (module docstring)."""

    Config = FsdpConfig
    shards_parameters = True
    verdict_all_reduces = True

    def __init__(self, ctx: Context, buckets: list[Bucket], parts: StrategyParts) -> None:
        super().__init__(ctx, buckets, parts)
        if parts.module is None:
            raise ConfigError("exchange.strategy: 'fsdp' needs the model (build it through Engine)")
        if parts.codec.wire_dtype is not None:
            raise ConfigError(
                "exchange.compress: fsdp reduce-scatters gradients in its reduce_dtype, not "
                "with scaled fp16 messages; set exchange.options.reduce_dtype instead"
            )
        config: FsdpConfig = parts.config or FsdpConfig()
        module = parts.module
        before = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
        self.reader = _Reader(module)  # a plain copy of the module's structure (no tensors)
        self.mesh = _mesh(ctx)
        self.roots, self.units = _shard(module, parts.entries or [module], self.mesh, config)
        after = dict(module.named_parameters(remove_duplicate=False))
        self.renamed = {old: after[name] for old, name in before.items()}  # id -> DTensor
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.module = module
        self._read_fresh = False  # the reader holds this step's parameters
        self._unit_bytes = sum(_local(p).numel() * p.element_size() for p in module.parameters())
        self._passes = 3 if config.reshard_after_forward else 2  # gathers + reduce-scatter

    # -- the step -----------------------------------------------------------------------------
    def gradient_scale(self) -> float:
        return 1.0  # fully_shard's reduce-scatter averages over the data ranks itself

    def begin_step(self) -> None:
        super().begin_step()
        for p in self.params:
            p.grad = None
        self._read_fresh = False
        self.reader.drop()

    def before_backward(self, last: bool) -> None:
        for root in self.roots:  # reduce-scatter on the last micro-batch only
            root.set_requires_gradient_sync(last)

    def launch(self, bucket: Bucket) -> None:
        raise AssertionError("fsdp has no gradient buckets")

    def finish(self) -> None:
        # Backward's end waited for every reduce-scatter (fully_shard's final callback).
        world = self.ctx.world_size
        volume = self._passes * self._unit_bytes * (world - 1)  # per rank, ring collectives
        self.count_bytes(volume, volume)

    def inspect_gradients(
        self, want_norm: bool, riders: torch.Tensor | None = None
    ) -> tuple[bool, float | None]:
        """Each rank checks its shards; one all-reduce sums the verdicts, the squares of the
        norm and ``riders`` (the step's global loss)."""
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        bad = float(self.local_loss_bad or holds_nonfinite(grads))
        squares = sum(
            (g.float().square().sum() for g in grads), torch.zeros((), device=self.ctx.device)
        )
        extra = riders if riders is not None else torch.zeros(0, device=self.ctx.device)
        message = torch.cat(
            [torch.stack([torch.tensor(bad, device=self.ctx.device), squares]).double(), extra]
        )
        dist.all_reduce(message, group=self.ctx.group)
        if riders is not None:
            riders.copy_(message[2:])
        verdict = bool(message[0] > 0)
        return verdict, float(message[1].sqrt()) if want_norm else None

    def scale_gradients(self, factor: float) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor)

    def sync(self) -> None:
        """The sharded parameters registered again: a forward outside a step (validation,
        with ``reshard_after_forward = false``) leaves the gathered ones in their place."""
        for unit in [*self.units, *self.roots]:
            unit.reshard()

    def update(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()  # parameters no rank used kept grad = None: the optimizer skips them

    # -- the model's parameters ------------------------------------------------------------------
    def adopt_optimizer(
        self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]
    ) -> torch.optim.Optimizer:
        """The user's optimizer, its groups pointed at the sharded parameters (the same object
        and hyperparameters; an LR scheduler attached to it keeps acting)."""
        if any(optimizer.state.values()):
            raise ConfigError(
                f"optimizer: {type(optimizer).__name__} already holds state, which 'fsdp' cannot "
                "shard; pass a fresh optimizer (resume through phalanx checkpoints)"
            )
        for group in optimizer.param_groups:
            group["params"] = [self.renamed.get(id(p), p) for p in group["params"]]
        del params
        return optimizer

    def sharded_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.params)

    def read_module(self, module: nn.Module) -> nn.Module:
        """A plain module with the whole updated parameters, gathered from every rank: a
        collective. Every rank that reads between steps must read; after the last step one
        rank may read alone, since ``close`` on the others makes the same gathers."""
        del module
        if not self._read_fresh:
            self.sync()
            self.reader.fill(self.module)
            self._read_fresh = True
        return self.reader.module

    def forward_module(self, module: nn.Module) -> nn.Module:
        return module  # forward through the shards: each unit gathered as it runs

    # -- state ------------------------------------------------------------------------------------
    def state_pieces(self, value: torch.Tensor, p: torch.Tensor) -> list[tuple[int, Any]]:
        """This rank's rows of a per-element state value (a DTensor like ``p``)."""
        return [(_flat_start(p), _local(value).detach().reshape(-1))]

    def state_from_pieces(self, pieces: list[tuple[int, Any]], p: torch.Tensor, what: str) -> Any:
        del what
        return _sharded_value(pieces, p)

    def owned_ranges(self, params: list[torch.nn.Parameter]) -> dict[int, list[tuple[int, int]]]:
        ranges = {}
        for i, p in enumerate(params):
            start = _flat_start(p)
            ranges[i] = [(start, start + _local(p).numel())] if _local(p).numel() else []
        return ranges

    def optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]
    ) -> dict[str, Any]:
        raise ConfigError(
            "optimizer_state_dict: fsdp keeps each rank's rows only; save through "
            "phalanx.checkpoint (every rank writes its own part)"
        )

    def optimizer_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        return sum(
            _local(t).numel() * t.element_size()
            for s in optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )

    def close(self) -> None:
        # The collective a rank-0-only read after the last step waits for (read_module).
        try:
            if not self._read_fresh and dist.is_initialized():
                self.read_module(self.module)
        finally:
            super().close()


# -- sharding -------------------------------------------------------------------------------------
def _mesh(ctx: Context) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(ctx.group, ctx.device.type)


def _shard(
    module: nn.Module, entries: list[nn.Module], mesh: Any, config: FsdpConfig
) -> tuple[list[Any], list[Any]]:
    """``fully_shard`` on each unit (bottom-up), then on the modules the step calls (the
    model, or a pipeline's stages: torch's stages drive a root's gradient sync themselves),
    which hold what no unit does; prefetch set between units in forward order and in backward
    order. Returns (roots, units in forward order)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES.get(config.param_dtype or ""),
        reduce_dtype=DTYPES.get(config.reduce_dtype or ""),
    )
    units: list[Any] = _units(module, config.units)  # FSDPModules once sharded
    for unit in reversed(units):
        fully_shard(
            unit, mesh=mesh, reshard_after_forward=config.reshard_after_forward, mp_policy=policy
        )
    roots = [
        fully_shard(entry, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        for entry in entries
    ]
    if config.prefetch > 0 and len(units) > 1:
        for i, unit in enumerate(units):
            ahead = units[i + 1 : i + 1 + config.prefetch]
            behind = units[max(0, i - config.prefetch) : i][::-1]
            if ahead:
                unit.set_modules_to_forward_prefetch(ahead)
            if behind:
                unit.set_modules_to_backward_prefetch(behind)
    return roots, units


def _units(module: nn.Module, names: list[str]) -> list[nn.Module]:
    """The units in forward (registration) order: the named classes' modules (outermost
    first match), or the top-level children holding parameters; a unit sharing a parameter
    with the rest of the model (tied weights) is left to the root."""
    if names:
        picked = [m for m in module.modules() if m is not module and type(m).__name__ in names]
        if not picked:
            raise ConfigError(
                f"exchange.options.units: no submodule of class {', '.join(names)} in the model; "
                "name classes it holds (e.g. its block class) or leave units empty"
            )
        picked = [m for m in picked if not any(o is not m and _contains(o, m) for o in picked)]
    else:
        picked = [c for c in module.children() if any(True for _ in c.parameters())]
    return [u for u in picked if not _shares_parameters(u, module)]


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _shares_parameters(unit: nn.Module, model: nn.Module) -> bool:
    """Whether a parameter of ``unit`` is also registered outside it (tied weights)."""
    inside = {id(m) for m in unit.modules()}
    mine = {id(p) for p in unit.parameters()}
    return any(
        id(p) in mine
        for m in model.modules()
        if id(m) not in inside
        for p in m.parameters(recurse=False)
    )


# -- shards -------------------------------------------------------------------------------------
def _local(t: Any) -> torch.Tensor:
    """This rank's part of a DTensor (the tensor itself otherwise)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _flat_start(p: torch.Tensor) -> int:
    """The flat index of this rank's first element of ``p``: its rows are torch.chunk's
    share of dim 0 (ceil(rows / P) each, the last shorter or empty)."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None or p.dim() == 0:
        return 0
    rows, world, rank = p.shape[0], mesh.size(), mesh.get_local_rank()
    per = math.ceil(rows / world)
    return min(rank * per, rows) * (p.numel() // max(1, rows))


def _sharded_value(value: list[tuple[int, Any]], p: torch.Tensor) -> Any:
    """A loaded state value: per-element pieces (this rank's rows) as a DTensor like ``p``."""
    local = _local(p)
    flat = torch.empty(local.numel(), dtype=value[0][1].dtype, device=local.device)
    start = _flat_start(p)
    for piece_start, piece in value:
        lo, hi = max(start, piece_start), min(start + local.numel(), piece_start + piece.numel())
        if hi > lo:
            flat[lo - start : hi - start].copy_(piece[lo - piece_start : hi - piece_start])
    from torch.distributed.tensor import DTensor

    shaped = flat.view(local.shape)
    if not isinstance(p, DTensor):
        return shaped
    return DTensor.from_local(
        shaped, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


# -- reads of the whole model -------------------------------------------------------------------
class _Reader:
    """A copy of the module tree made before sharding: the same classes, buffers (shared),
    and hooks, with parameters as meta placeholders until ``fill`` gathers them (tied
    parameters stay tied: one placeholder, one gathered tensor)."""

    def __init__(self, module: nn.Module) -> None:
        self._placeholders: dict[int, nn.Parameter] = {}
        self._names: dict[int, str] = {}  # placeholder id -> the parameter's name
        for name, p in module.named_parameters():
            self._names[id(p)] = name
        self.module = self._copy(module, {})
        self._slots = [
            (m, key, p)
            for m in self.module.modules()
            for key, p in m._parameters.items()
            if p is not None
        ]

    def _copy(self, m: nn.Module, copies: dict[int, nn.Module]) -> nn.Module:
        if id(m) in copies:
            return copies[id(m)]
        new = copy.copy(m)
        copies[id(m)] = new
        for key, value in m.__dict__.items():  # hook tables of its own: sharding adds hooks
            if "hook" in key and isinstance(value, (dict, OrderedDict)):
                new.__dict__[key] = type(value)(value)
        new.__dict__["_parameters"] = {
            key: None if p is None else self._placeholder(p) for key, p in m._parameters.items()
        }
        new.__dict__["_buffers"] = dict(m._buffers)  # the same tensors: reads see them as they are
        new.__dict__["_modules"] = {
            key: None if c is None else self._copy(c, copies) for key, c in m._modules.items()
        }
        return new

    def _placeholder(self, p: nn.Parameter) -> nn.Parameter:
        if id(p) not in self._placeholders:
            meta = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            self._placeholders[id(p)] = meta
            self._names[id(meta)] = self._names.get(id(p), "")
        return self._placeholders[id(p)]

    def fill(self, sharded: nn.Module) -> None:
        """Gather every parameter of ``sharded`` (a collective, in the same order on every
        rank) into this copy."""
        named = dict(sharded.named_parameters())
        full: dict[int, nn.Parameter] = {}
        with torch.no_grad():
            for placeholder in self._placeholders.values():
                p = named[self._names[id(placeholder)]]
                whole = p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                full[id(placeholder)] = nn.Parameter(whole, requires_grad=p.requires_grad)
        for m, key, placeholder in self._slots:
            m._parameters[key] = full[id(placeholder)]

    def drop(self) -> None:
        """Free the gathered copy (placeholders back)."""
        for m, key, placeholder in self._slots:
            m._parameters[key] = placeholder
