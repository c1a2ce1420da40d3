"""``fsdp``: parameters, gradients and optimizer state sharded over the data ranks by torch's
``fully_shard`` (FSDP2). Units, reads of the model and checkpoints: docs/exchange.md, "`fsdp`".

In the Engine's step (phalanx.engine; the same phases):
  Phase 1 (``begin_step``): gradients cleared.
  Phase 2: all-gather each unit before forward and backward, reduce-scatter its gradients.
  Phase 4 (``finish`` / ``inspect_gradients``): verdict, norm and loss in one all-reduce.
  Phase 5 (``update``): the optimizer steps this rank's shards (1/P of every tensor).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.errors import CheckpointError, ConfigError
from phalanx.exchange.base import STRATEGIES, Strategy, StrategyParts
from phalanx.exchange.base import local_tensor as _local
from phalanx.exchange.buckets import Bucket
from phalanx.exchange.comm import global_rank, wait_all
from phalanx.exchange.compression import Codec
from phalanx.exchange.messages import MessageSchedule, Phase, UnitPhases, ring_rounds
from phalanx.exchange.ring import pieces, ring_reduce_scatter
from phalanx.exchange.sharding import Optimizer, Params
from phalanx.fields import option, require
from phalanx.optim import state as optimizer_state
from phalanx.runtime.context import Context

if TYPE_CHECKING:
    from phalanx.exchange.messages import WireCodec

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
        doc="class names of the submodules that become units (empty: the whole model as one "
        "unit up to whole_model_mb, above it each top-level child module with parameters, "
        "i.e. a config model's layers)",
    )
    whole_model_mb: float = option(
        512.0,
        "with units empty: a model whose parameters take at most this many MiB is one unit "
        "(one all-gather per step, no per-layer collectives) and its frozen parameters stay "
        "whole on every rank (nothing to reduce, nothing to gather); 0: always per layer",
    )

    def __post_init__(self) -> None:
        require(self.prefetch >= 0, "prefetch", f"must be >= 0, got {self.prefetch}")
        require(
            self.whole_model_mb >= 0, "whole_model_mb", f"must be >= 0, got {self.whole_model_mb}"
        )
        for key in ("param_dtype", "reduce_dtype"):
            value = getattr(self, key)
            require(
                value is None or value in DTYPES,
                key,
                f"got {value!r}; allowed: {', '.join(DTYPES)} or None",
            )


def wire_scale(dtype: str | None) -> float:
    """Bytes on the wire per float32 byte of the planner's profile, in ``dtype`` (None: float32)."""
    return DTYPES[dtype or "float32"].itemsize / 4


class FullyShardedSchedule(MessageSchedule):
    """Per unit: ring all-gathers (``param_dtype``) before forward and backward, a ring
    reduce-scatter (``reduce_dtype``) after backward."""

    config: FsdpConfig
    unit_label = "per layer"

    def bucket_phases(self, world: int, codec: WireCodec, nbytes: float) -> list[Phase]:
        return self.unit_phases(world).reduce  # a unit's gradients (sim.py runs unit_phases)

    def unit_phases(self, world: int, reduce_scatter_all_reduces: bool = False) -> UnitPhases:
        """``reduce_scatter_all_reduces``: Gloo all-reduces and slices (twice a ring's bytes)."""
        c = self.config
        if world < 2:
            return UnitPhases([], [], [], c.prefetch)
        table = ring_rounds(world, reduce=False, gather=True, grad=False)
        gather_scale = wire_scale(c.param_dtype)
        # torch's reduce-scatter: the backend's collective, its adds inside the calibration
        reduce_table = ring_rounds(world, gather=reduce_scatter_all_reduces, backend=True)
        reduce = Phase(
            "reduce-scatter", reduce_table, scale=wire_scale(c.reduce_dtype or c.param_dtype)
        )
        regather = Phase("all-gather (backward)", table, scale=gather_scale)
        return UnitPhases(
            [Phase("all-gather", table, scale=gather_scale)],
            [regather] if c.reshard_after_forward else [],
            [reduce],
            c.prefetch,
        )

    def optimizer_fraction(self, world: int) -> float:
        return 1.0 / world  # each rank steps its own shard

    def on_thread(self, codec: WireCodec, last: bool) -> bool:
        return False  # torch's own collectives, issued from the compute thread's hooks

    def describe(self) -> str:
        c = self.config
        dtypes = f", param {c.param_dtype}" if c.param_dtype else ""
        dtypes += f", reduce {c.reduce_dtype}" if c.reduce_dtype else ""
        return (
            f"fsdp (reshard_after_forward={str(c.reshard_after_forward).lower()}, "
            f"prefetch={c.prefetch}{dtypes})"
        )


@STRATEGIES.register("fsdp")
class FullyShardedStrategy(Strategy):
    """Sharded parameters, gradients and state through ``fully_shard``."""

    Config = FsdpConfig
    Messages = FullyShardedSchedule
    shards_parameters = True
    verdict_all_reduces = True

    @classmethod
    def refuses(cls, config: Any, codec: Codec) -> str | None:
        if codec.wire_dtype is None:
            return None
        return (
            f"fsdp reduce-scatters gradients in its reduce_dtype, not with {codec.name} "
            "compression (set exchange.options.reduce_dtype instead)"
        )

    def __init__(self, ctx: Context, buckets: list[Bucket], parts: StrategyParts) -> None:
        super().__init__(ctx, buckets, parts)
        if parts.module is None:
            raise ConfigError("exchange.strategy: 'fsdp' needs the model (build it through Engine)")
        if why := self.refuses(parts.config, parts.codec):
            raise ConfigError(f"exchange.compress: {why}")
        config: FsdpConfig = parts.config or FsdpConfig()
        module = parts.module
        before = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
        self.mesh = _mesh(ctx)
        self.roots, self.units = _shard(module, parts.entries or [module], self.mesh, config)
        self._comms = _gloo_collectives([*self.units, *self.roots]) if ctx.backend == "gloo" else []
        after = dict(module.named_parameters(remove_duplicate=False))
        self.renamed = {old: after[name] for old, name in before.items()}  # id -> DTensor
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.module = module
        self.shard_reads = _ShardReads(module)  # the user's state_dict() calls refused
        self._volume = _volume(module, config.reshard_after_forward and bool(self.units), ctx)

    def gradient_scale(self) -> float:
        return 1.0  # fully_shard's reduce-scatter averages over the data ranks itself

    def begin_step(self) -> None:
        super().begin_step()
        for p in self.params:
            p.grad = None

    def before_backward(self, last: bool) -> None:
        for root in self.roots:  # reduce-scatter on the last micro-batch only
            root.set_requires_gradient_sync(last)

    def launch(self, bucket: Bucket) -> None:
        raise AssertionError("fsdp has no gradient buckets")

    def finish(self) -> None:
        # Backward's end waited for every reduce-scatter (fully_shard's final callback).
        self.count_bytes(self._volume, self._volume)

    def inspect_gradients(
        self, want_norm: bool, riders: torch.Tensor | None = None
    ) -> tuple[bool, float | None]:
        """One all-reduce of verdicts, norm squares and ``riders``; one foreach pass over rows."""
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        norms = [n.double() for n in torch._foreach_norm(grads)] if grads else []
        squares = (
            torch.stack(norms).square().sum() if norms else torch.zeros((), device=self.ctx.device)
        )
        bad = float(self.local_loss_bad or not bool(torch.isfinite(squares)))
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
        """Reshard: a forward outside a step (validation) may leave gathered parameters."""
        for unit in [*self.units, *self.roots]:
            unit.reshard()

    def update(self, optimizer: Optimizer) -> None:
        optimizer.step()  # parameters no rank used kept grad = None: the optimizer skips them

    def adopt_optimizer(self, optimizer: Optimizer, params: Params) -> Optimizer:
        """The user's optimizer on the shards, its state cut to rows, its ``state_dict`` refused."""
        del params
        for group in optimizer.param_groups:
            group["params"] = [self.renamed.get(id(p), p) for p in group["params"]]
        loaded = list(optimizer.state.items())
        optimizer.state.clear()
        for p, entry in loaded:
            sharded = self.renamed.get(id(p), p)
            optimizer.state[sharded] = {k: _rows(v, sharded) for k, v in entry.items()}
        optimizer_state.refuse_direct_state(optimizer, "fsdp")
        return optimizer

    def read_module(self, module: nn.Module) -> nn.Module:
        """The model itself (sharded; a forward through it is a collective)."""
        return module

    def full_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """``module.state_dict()`` whole, gathered onto the CPU tensor by tensor (a collective)."""
        with self.shard_reads.allowed():
            sharded = module.state_dict(keep_vars=True)
        whole: dict[int, Any] = {}
        with _gathering("full_state_dict"):
            for value in sharded.values():
                if id(value) not in whole:
                    whole[id(value)] = _whole(value)
        return {name: whole[id(value)] for name, value in sharded.items()}

    def own_reads(self) -> AbstractContextManager[None]:
        return self.shard_reads.allowed()

    def forward_module(self, module: nn.Module) -> nn.Module:
        return module  # forward through the shards: each unit gathered as it runs

    def state_pieces(self, value: torch.Tensor, p: torch.Tensor) -> list[tuple[int, Any]]:
        """This rank's rows of a per-element state value (a DTensor like ``p``)."""
        return [(_flat_start(p), _local(value).detach().reshape(-1))]

    def state_from_pieces(self, pieces: list[tuple[int, Any]], p: torch.Tensor, what: str) -> Any:
        del what
        return _sharded_value(pieces, p)

    def owned_ranges(self, params: Params) -> dict[int, list[tuple[int, int]]]:
        ranges = {}
        for i, p in enumerate(params):
            start = _flat_start(p)
            ranges[i] = [(start, start + _local(p).numel())] if _local(p).numel() else []
        return ranges

    def optimizer_state_dict(self, optimizer: Optimizer, params: Params) -> dict[str, Any]:
        """Torch's format, per-element values gathered whole onto the CPU (a collective)."""
        del params
        state = optimizer_state.state_of(optimizer)  # the values: this rank's rows
        with _gathering("optimizer_state_dict"):
            whole = {
                n: {key: _whole(value) for key, value in state["state"][n].items()}
                for n in sorted(state["state"])  # the same order on every rank
            }
        return {"state": whole, "param_groups": state["param_groups"]}

    def load_optimizer_state_dict(
        self, optimizer: Optimizer, params: Params, state: dict[str, Any]
    ) -> None:
        """Load torch's format: this rank keeps its rows of every per-element value."""
        del params
        if not isinstance(state, dict) or not {"state", "param_groups"} <= set(state):
            raise CheckpointError(
                "load_optimizer_state_dict: expected an optimizer state dict ('state', "
                f"'param_groups'), got {type(state).__name__}"
            )
        order = [p for group in optimizer.param_groups for p in group["params"]]
        numbers = [n for group in state["param_groups"] for n in group["params"]]
        if len(numbers) != len(order):
            raise CheckpointError(
                f"load_optimizer_state_dict: the state's groups hold {len(numbers)} parameters, "
                f"the optimizer's {len(order)}; it is from another model or optimizer"
            )
        param_of = dict(zip(numbers, order))
        rows = {
            n: {key: _rows(value, param_of[n]) for key, value in entry.items()}
            for n, entry in state["state"].items()
        }
        optimizer_state.load_into(optimizer, {**state, "state": rows})

    def close(self) -> None:
        for comm in self._comms:  # the pooled buffers go (a forward after this allocates anew)
            comm.pool.clear()
        super().close()


def _mesh(ctx: Context) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(ctx.group, ctx.device.type)


def _shard(
    module: nn.Module, entries: list[nn.Module], mesh: Any, config: FsdpConfig
) -> tuple[list[Any], list[Any]]:
    """``fully_shard`` on each unit, then on what the step calls; prefetch between units.
    Returns (roots, units in forward order)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES.get(config.param_dtype or ""),
        reduce_dtype=DTYPES.get(config.reduce_dtype or ""),
    )
    whole = not config.units and _bytes(module) <= config.whole_model_mb * 2**20
    frozen = {p for p in module.parameters() if not p.requires_grad} if whole else set()
    units: list[Any] = [] if whole else _units(module, config.units)  # FSDPModules once sharded
    for unit in reversed(units):
        fully_shard(
            unit, mesh=mesh, reshard_after_forward=config.reshard_after_forward, mp_policy=policy
        )
    roots = [
        fully_shard(
            entry,
            mesh=mesh,
            reshard_after_forward=False,
            mp_policy=policy,
            ignored_params=frozen or None,
        )  # fmt: skip
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
    """The units in forward order (a unit sharing a parameter is left to the root)."""
    if names:
        picked = [m for m in module.modules() if m is not module and type(m).__name__ in names]
        if not picked:
            raise ConfigError(
                f"exchange.options.units: no submodule of class {', '.join(names)} in the model; "
                "name classes it holds (e.g. its block class) or leave units empty"
            )
        picked = [m for m in picked if not any(o is not m and _contains(o, m) for o in picked)]
    else:
        picked = _children_with_parameters(module)
    return [u for u in picked if not _shares_parameters(u, module)]


def _children_with_parameters(module: nn.Module) -> list[nn.Module]:
    """Top-level children holding parameters, a container's (ModuleList, ModuleDict) own."""
    picked = []
    for child in module.children():
        if next(child.parameters(), None) is None:
            continue
        container = isinstance(child, (nn.ModuleList, nn.ModuleDict))
        picked += _children_with_parameters(child) if container else [child]
    return picked


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _volume(module: nn.Module, regather: bool, ctx: Context) -> int:
    """Bytes a rank sends (and receives) per step: ring all-gathers and a reduce-scatter."""
    sharded = [p for p in module.parameters() if hasattr(p, "to_local")]
    rows = sum(_local(p).numel() * p.element_size() for p in sharded)
    grads = sum(_local(p).numel() * p.element_size() for p in sharded if p.requires_grad)
    return ((2 if regather else 1) * rows + grads) * (ctx.world_size - 1)


def _gloo_collectives(modules: list[Any]) -> list[_Buffers]:
    """fully_shard's collectives on Gloo as point-to-point rings (3x faster, docs/exchange.md)."""
    gather, scatter = _RingAllGather(), _RingReduceScatter()
    for m in modules:
        if hasattr(m, "set_custom_reduce_scatter"):
            m.set_custom_all_gather(gather)
            m.set_custom_reduce_scatter(scatter)
    return [gather, scatter]


# glibc maps every host block above its largest mmap threshold (32 MiB) afresh, and the
# kernel zero-fills its pages at first touch: a whole ResNet-18's all-gather output and
# reduce-scatter input (45 MiB each) cost ~10 ms apiece per step that way here.
POOLED_BYTES = 32 * 2**20
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # tensors using a storage (+1)


class _Buffers:
    """``allocate`` of fully_shard's buffers: host buffers above ``POOLED_BYTES`` are pooled,
    reused once only the pool holds them (at most ``POOLED`` idle, least recent first)."""

    POOLED = 4

    def __init__(self) -> None:
        self.pool: list[torch.Tensor] = []  # least recently handed out first

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(int(n) for n in size)
        if device.type != "cpu" or _USE_COUNT is None or numel * dtype.itemsize <= POOLED_BYTES:
            return torch.empty(*size, dtype=dtype, device=device)
        idle = [t for t in self.pool if _USE_COUNT(t.untyped_storage()._cdata) <= 2]
        match = next((t for t in idle if t.numel() == numel and t.dtype == dtype), None)
        gone = match if match is not None else idle[0] if len(idle) >= self.POOLED else None
        self.pool = [t for t in self.pool if t is not gone]  # (tensors' == is elementwise)
        if match is None:
            match = torch.empty(numel, dtype=dtype, device=device)
        self.pool.append(match)
        return match.view(*size)


class _RingReduceScatter(_Buffers):
    """fully_shard's ReduceScatter over the ring, the last step adding into the output."""

    def __init__(self) -> None:
        super().__init__()
        self.codec = Codec()  # no compression: its arena holds the incoming pieces

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> None:
        p, rank, n = dist.get_world_size(group), dist.get_rank(group), output_tensor.numel()
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # a premultiplied sum: Gloo's
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            scatter(output_tensor, input_tensor, op=op, group=group)
            return
        start = input_tensor.storage_offset() + rank * n  # of this rank's part

        def into_output(message: torch.Tensor, part: torch.Tensor) -> None:
            out = output_tensor[part.storage_offset() - start :][: part.numel()]
            torch.add(part, message, out=out)
            if op == dist.ReduceOp.AVG:
                out.div_(p)

        chunks = [(i * n, (i + 1) * n) for i in range(p)]
        ring_reduce_scatter(input_tensor, chunks, rank, p, group, self.codec, into_output)


class _RingAllGather(_Buffers):
    """fully_shard's AllGather: step s sends part rank - s, receives part rank - s - 1 in place."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        async_op: bool = False,
    ) -> None:
        p, rank, n = dist.get_world_size(group), dist.get_rank(group), input_tensor.numel()
        mine = output_tensor[rank * n : (rank + 1) * n]
        if mine.data_ptr() != input_tensor.data_ptr():  # fully_shard copies it in place
            mine.copy_(input_tensor)
        nxt, prev = global_rank(group, (rank + 1) % p), global_rank(group, (rank - 1) % p)
        for s in range(p - 1):
            send, recv = (rank - s) % p, (rank - s - 1) % p
            works = [dist.irecv(output_tensor[a:b], prev, group=group)
                     for a, b in pieces(recv * n, (recv + 1) * n)]  # fmt: skip
            works += [dist.isend(output_tensor[a:b], nxt, group=group)
                      for a, b in pieces(send * n, (send + 1) * n)]  # fmt: skip
            wait_all(works)


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


def _flat_start(p: torch.Tensor) -> int:
    """The flat index of this rank's first element of ``p`` (torch.chunk's rows of dim 0)."""
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


class _ShardReads:
    """Refuses the user's ``state_dict()`` (DTensor rows load into no plain model)."""

    def __init__(self, model: nn.Module) -> None:
        self.depth = 0  # > 0 inside ``allowed``
        for m in model.modules():
            if next(m.parameters(recurse=False), None) is not None:
                m.register_state_dict_pre_hook(self)

    @contextmanager
    def allowed(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        del module, prefix, keep_vars
        if self.depth == 0:
            raise CheckpointError(
                "state_dict(): under 'fsdp' the model holds this rank's rows of every parameter "
                "only; call engine.full_state_dict() on every rank (whole tensors, the model's "
                "own names), then save it from one"
            )


@contextmanager
def _gathering(what: str) -> Iterator[None]:
    """A gather of every rank's rows: a rank that is not there is named in one line."""
    try:
        yield
    except RuntimeError as e:  # the backend's words for a peer that did not take part
        said = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise CheckpointError(
            f"{what}: under 'fsdp' it gathers every rank's rows, and a rank did not take part "
            f"(it left or was elsewhere); call it on every rank, then save from one ({said})"
        ) from e


def _whole(value: Any) -> Any:
    """A whole tensor on the CPU from a DTensor (a collective) or a tensor; else ``value``."""
    if callable(getattr(value, "full_tensor", None)):
        return value.full_tensor().detach().cpu()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    return value


def _rows(value: Any, p: torch.Tensor) -> Any:
    """This rank's rows of a whole per-element value of ``p``; other tensors copied."""
    if not isinstance(value, torch.Tensor) or callable(getattr(value, "to_local", None)):
        return value
    if value.dim() == 0 or value.shape != p.shape:
        return value.detach().clone()
    return _sharded_value([(0, value.detach().reshape(-1))], p)
