"""The Strategy protocol of gradient exchange, its registry, factory and Config.

A Strategy receives full buckets during backward and makes every rank end the step with the
same updated parameters. In the Engine's step (phalanx.engine; the same phase numbers):
  Phase 2: ``launch(bucket)`` per bucket, in order, as backward fills it (and in Phase 3);
  Phase 4: ``finish()``: each ``flat`` holds the mean gradient (owner updates: their shards);
  Phase 5: ``update(optimizer)``: apply the update (default: ``optimizer.step()``).
Strategies never see model code; the Engine never branches on a strategy's name.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch

from phalanx.compile import compile_layers
from phalanx.errors import ConfigError
from phalanx.exchange.buckets import FIRST_BUCKET_BYTES, Bucket
from phalanx.exchange.comm import CommThread
from phalanx.exchange.compression import CODECS, Codec
from phalanx.exchange.messages import MessageSchedule
from phalanx.exchange.sharding import (
    Groups,
    Optimizer,
    Params,
    ShardState,
    copy_pieces,
    merged_groups,
)
from phalanx.fields import ConfigValueError, from_dict, option, require
from phalanx.optim.state import load_into
from phalanx.registry import Registry
from phalanx.runtime.context import Context

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], Optimizer]


@dataclass(kw_only=True)
class ExchangeConfig:
    """How gradients travel between ranks."""

    strategy: str = option("allreduce", "registered exchange strategy name")
    bucket_mb: float | str = option(
        25.0, "fusion threshold in MiB, or 'auto' (derived from the measured link and backward)"
    )
    options: dict = option(factory=dict, doc="the strategy's own options (see docs/exchange.md)")
    compress: str | None = option(
        "none", "gradient messages: none, fp16 or bf16 (scaled, F13); None means none"
    )
    first_bucket_mb: float = option(
        FIRST_BUCKET_BYTES / 2**20,
        "the first bucket's size in MiB: small, so communication starts early (as DDP)",
    )

    def __post_init__(self) -> None:
        self.compress = self.compress or "none"
        require(
            self.strategy in STRATEGIES,
            "strategy",
            f"unknown strategy {self.strategy!r}; known: {', '.join(STRATEGIES.names())}",
        )
        require(
            self.bucket_mb == "auto"
            or (not isinstance(self.bucket_mb, str) and self.bucket_mb > 0),
            "bucket_mb",
            f"got {self.bucket_mb!r}; allowed: a size > 0 (MiB) or 'auto'",
        )
        require(
            self.compress in CODECS,
            "compress",
            f"unknown compression {self.compress!r}; allowed: {', '.join(CODECS.names())}",
        )
        require(
            self.first_bucket_mb > 0, "first_bucket_mb", f"must be > 0, got {self.first_bucket_mb}"
        )
        strategy_config(self.strategy, self.options)

    def check_world(self, world_size: int) -> None:
        """Start-up check of options that depend on the world size (before any group work)."""
        strategy_factory(self.strategy, self.options).check_world(world_size)


def strategy_config(name: str, options: dict[str, Any]) -> Any:
    """The strategy's Config built from ``options`` (ConfigValueError naming options.KEY)."""
    cls = getattr(STRATEGIES.get(name), "Config", None)
    if cls is None:
        require(not options, "options", f"strategy {name!r} takes no options")
        return None
    try:
        return from_dict(cls, options, "options")
    except ConfigError as e:
        key, _, reason = str(e).partition(": ")
        raise ConfigValueError(key, reason) from None


ThreadSpan = tuple[str, str, int, int, float, float]  # lane, name, bucket, bytes, start, end


def stamp_done(bucket: Bucket, handle: Any) -> Any:
    """Set ``bucket.done_time`` when ``handle`` (a Work or a Future) completes, for traces."""

    def stamp(*_: Any) -> None:
        bucket.done_time = time.perf_counter()

    if isinstance(handle, Future):
        handle.add_done_callback(stamp)
    elif hasattr(handle, "get_future"):
        handle.get_future().add_done_callback(stamp)
    return handle


def holds_nonfinite(tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` hold inf/NaN (or overflow fp32), from one fp32 sum per tensor."""
    if not tensors:
        return False
    sums = torch.stack([t.sum(dtype=torch.float32) for t in tensors])
    return not bool(torch.isfinite(sums).all())


@dataclass(kw_only=True)
class StrategyParts:
    """What the Engine hands every strategy it builds, at construction and on each rebuild."""

    codec: Codec = field(default_factory=Codec)  # kept across rebuilds (run-long counters)
    config: Any = None  # the strategy's own Config (its options); None: the defaults
    # id(parameter) -> the user's optimizer group: sharded strategies cut shards there
    group_of: dict[int, int] | None = None
    module: torch.nn.Module | None = None  # this rank's model (``shards_parameters`` wrap it)
    entries: list[torch.nn.Module] | None = None  # what the step calls (pipeline stages)
    # the previous layout's strategy: its thread, listeners and spans are taken over
    previous: Strategy | None = None


class Strategy(ABC):
    """Base class of exchange strategies (phases: the module docstring), built again per bucket
    layout; this base implements the replicated optimizer."""

    # parameters update while gradients arrive: a bad loss is agreed before the exchange, and
    # nothing can rescale the gradient first (no clipping, no fp16 unscaling)
    updates_during_exchange: bool = False
    # the optimizer steps tensors of the bucket layout (owners' shards): a rebuild moves state
    optimizer_follows_layout: bool = False
    # ``inspect_gradients`` all-reduces over the data group: the global loss rides in it
    verdict_all_reduces: bool = False
    # the model's tensors become shards at construction: the Engine builds no buckets for it
    shards_parameters: bool = False
    Config: type | None = None  # the options' dataclass, for strategies that take options
    Messages: type[MessageSchedule]  # its messages per bucket, for the planner

    def __init__(self, ctx: Context, buckets: list[Bucket], parts: StrategyParts) -> None:
        self.ctx = ctx
        self.buckets = buckets
        self.codec: Codec = parts.codec
        self.group_of = parts.group_of
        self.local_loss_bad = False  # set by the non-finite guard in Phase 2
        self.bytes_sent = 0  # this step, counted by the strategy
        self.bytes_received = 0
        # forward's waits for arriving parameters: (bucket, start, end), perf_counter seconds
        self.param_waits: list[tuple[int, float, float]] = []
        # the communication thread's work for traces (a pull may end during the next step)
        self.thread_spans: list[ThreadSpan] = []
        # called in finish() with each bucket whose mean gradient is complete (allreduce, tree)
        self.bucket_listeners: list[Callable[[Bucket], None]] = []
        self._count_lock = threading.Lock()  # a communication thread may count too
        self.comm: CommThread | None = None  # ``comm_thread()``
        previous = parts.previous
        if previous is not None:  # the same thread, listeners and spans across layouts
            self.comm, previous.comm = previous.comm, None
            self.bucket_listeners = previous.bucket_listeners
            self.thread_spans = previous.thread_spans

    def comm_thread(self) -> CommThread:
        """The communication thread, started at the first call (or the previous layout's)."""
        if self.comm is None:
            self.comm = CommThread(self.ctx.device, self.ctx.group)
        return self.comm

    @classmethod
    def bucket_alignment(cls, config: Any, world_size: int, backend: str, codec: Codec) -> int:
        """Each bucket's flat length is padded to a multiple of this (e.g. p for scatters)."""
        del config, world_size, backend, codec
        return 1

    @classmethod
    def check_world(cls, config: Any, world_size: int) -> None:
        """One-line ConfigError if the strategy cannot run on ``world_size`` data ranks."""
        del config, world_size

    @classmethod
    def num_trainers(cls, config: Any, world_size: int) -> int:
        """How many of ``world_size`` ranks run forward and backward (the rest serve)."""
        del config
        return world_size

    @classmethod
    def refuses(cls, config: Any, codec: Codec) -> str | None:
        """Why the strategy cannot run with ``codec``'s compression (None: it can)."""
        del config, codec
        return None

    @classmethod
    def sums_whole_buckets(cls, config: Any, codec: Codec) -> bool:
        """Whether buckets arrive summed exactly, tail included (the loss rides in ``riders``)."""
        del config, codec
        return False

    @property
    def is_trainer(self) -> bool:
        """Whether this rank runs forward and backward (False on dedicated servers)."""
        return True

    def inspect_gradients(
        self, want_norm: bool, riders: torch.Tensor | None = None
    ) -> tuple[bool, float | None]:
        """After ``finish()``: (inf/NaN anywhere, the global norm if ``want_norm``), alike on every
        rank (here local: a bad loss poisoned the flags); ``riders``: summed in the verdict."""
        assert riders is None, "riders go only to a strategy whose verdict all-reduces"
        bad = holds_nonfinite([b.flat for b in self.buckets])
        if not want_norm:
            return bad, None
        squares = torch.stack([b.grads.float().square().sum() for b in self.buckets]).sum()
        return bad, float(squares.sqrt())

    def scale_gradients(self, factor: float) -> None:
        """Multiply the exchanged mean gradient by ``factor`` (gradient clipping)."""
        for bucket in self.buckets:
            bucket.grads.mul_(factor)

    def data_parallel(self) -> tuple[int, int]:
        """(index, count) of this rank among the ranks that train on data."""
        return self.ctx.rank, self.ctx.world_size

    def before_backward(self, last: bool) -> None:
        """Phase 2, before each micro-batch's backward (``last``: the one that exchanges)."""
        del last

    def read_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module to read the updated model from (``Engine.module``; after ``sync``)."""
        return module

    def forward_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module that runs this rank's forward outside a step (validation)."""
        return module

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        """The model's state with whole tensors (``Engine.full_state_dict``; after ``sync``)."""
        return module.state_dict()

    def own_reads(self) -> AbstractContextManager[None]:
        """A block in which phalanx reads the model's own state (``fsdp`` lets it through)."""
        return nullcontext()

    @classmethod
    def compile_model(cls, config: Any, module: torch.nn.Module) -> list[torch.nn.Module]:
        """``[train] compile`` as the strategy's hooks allow; returns the modules compiled."""
        del config
        return compile_layers(module)

    def register_module(self, module: torch.nn.Module) -> None:
        """Hook into the model if the strategy needs to (e.g. wait for parameters in forward)."""
        del module

    def adopt_optimizer(self, optimizer: Optimizer, params: Params) -> Optimizer:
        """The optimizer the Engine steps (sharded strategies point its groups at shards)."""
        del params
        return optimizer

    def carry_optimizer_state(self, optimizer: Optimizer, params: Params) -> Any:
        """Before a bucket rebuild: what ``rebind_optimizer`` needs (None: nothing moves)."""
        del optimizer, params
        return None

    def rebind_optimizer(self, optimizer: Optimizer, params: Params, carried: Any) -> None:
        """Point the *same* optimizer at the new layout with its state moved (schedulers act)."""
        del optimizer, params, carried

    def gradient_scale(self) -> float:
        """Factor the Engine folds into the loss so the exchanged sums are means (1/p)."""
        return 1.0 / self.data_parallel()[1]

    def bucket_exchanged(self, bucket: Bucket) -> None:
        """``finish()`` calls this as each bucket's mean is complete (the host mirror, F19)."""
        for listener in self.bucket_listeners:
            listener(bucket)

    def count_bytes(self, sent: int, received: int) -> None:
        """Add one exchange's bytes to this step's counters (thread-safe)."""
        with self._count_lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def begin_step(self) -> None:
        """Reset per-step counters before the first launch of a step."""
        self.bytes_sent = 0
        self.bytes_received = 0
        self.param_waits.clear()
        self.codec.num_nonfinite = 0

    def take_thread_spans(self) -> list[ThreadSpan]:
        """The communication thread's spans recorded since the last call."""
        spans, self.thread_spans = self.thread_spans, []
        return spans

    @abstractmethod
    def launch(self, bucket: Bucket) -> None:
        """Phase 2 (and 3): start exchanging ``bucket.flat`` (do not block on the network)."""

    @abstractmethod
    def finish(self) -> None:
        """Phase 4: wait for every launched exchange of this step."""

    def update(self, optimizer: Optimizer) -> None:
        """Phase 5: apply the update on every rank (buckets hold mean gradients)."""
        self.detach_unused_grads()
        optimizer.step()

    def detach_unused_grads(self) -> None:
        """Parameters no rank used (summed usage flags) keep ``grad = None``, as in one process."""
        flags = torch.cat([b.flags for b in self.buckets])
        if bool((flags > 0.5).all()):
            return
        for bucket in self.buckets:
            for p, flag in zip(bucket.params, bucket.flags.tolist()):
                if flag < 0.5:
                    p.grad = None

    def sync(self) -> None:
        """Wait for any background work (e.g. parameters still arriving)."""
        return None

    def optimizer_state_dict(self, optimizer: Optimizer, params: Params) -> dict[str, Any]:
        """Per-parameter optimizer state over ``params`` (collective where sharded)."""
        del params
        return optimizer.state_dict()

    def load_optimizer_state_dict(
        self, optimizer: Optimizer, params: Params, state: dict[str, Any]
    ) -> None:
        del params
        optimizer.load_state_dict(state)

    def optimizer_shards(self, optimizer: Optimizer, params: Params) -> tuple[ShardState, Groups]:
        """This rank's part of the state, gathering nothing: ``({index: {key: value or (flat start,
        1-D tensor) pieces}}, groups)``, ``groups``' ``params`` as indices in ``params``."""
        index = {id(p): i for i, p in enumerate(params)}
        state: ShardState = {}
        for p, entry in optimizer.state.items():
            if id(p) in index:
                state[index[id(p)]] = {
                    k: self.state_pieces(v, p) if _per_element(v, p) else v
                    for k, v in entry.items()
                }
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [index[id(p)] for p in g["params"] if id(p) in index],
            }
            for g in optimizer.param_groups
        ]
        return state, groups

    def owned_ranges(self, params: Params) -> dict[int, list[tuple[int, int]]]:
        """The flat element ranges of each parameter whose optimizer state this rank keeps."""
        return {i: [(0, p.numel())] for i, p in enumerate(params)}

    def load_optimizer_shards(
        self, optimizer: Optimizer, params: Params, state: ShardState, groups: Groups
    ) -> None:
        """Load state in ``optimizer_shards``' form whose pieces cover ``owned_ranges``."""
        index = {id(p): i for i, p in enumerate(params)}
        order = [p for g in optimizer.param_groups for p in g["params"]]
        loaded: ShardState = {}
        for n, p in enumerate(order):
            entry = state.get(index.get(id(p), -1))
            if not entry:
                continue
            loaded[n] = {
                key: self.state_from_pieces(value, p, f"{key!r} of parameter {index[id(p)]}")
                if isinstance(value, list)
                else value
                for key, value in entry.items()
            }
        load_into(optimizer, {"state": loaded, "param_groups": merged_groups(optimizer, groups)})

    def state_pieces(self, value: torch.Tensor, p: torch.Tensor) -> list[tuple[int, Any]]:
        """A per-element state value as the ``(flat start, 1-D tensor)`` pieces this rank keeps."""
        del p
        return [(0, value.detach().reshape(-1))]

    def state_from_pieces(self, pieces: list[tuple[int, Any]], p: torch.Tensor, what: str) -> Any:
        """The state value of ``p`` from pieces covering what this rank keeps."""
        full = torch.empty(p.numel(), dtype=pieces[0][1].dtype)
        if copy_pieces(pieces, 0, full) != p.numel():
            raise ValueError(
                f"optimizer state {what} is incomplete: load through phalanx.checkpoint.restore"
            )
        return full.view(p.shape)

    def optimizer_bytes(self, optimizer: Optimizer) -> int:
        """Bytes of optimizer state held by this rank."""
        return sum(
            local_tensor(t).numel() * t.element_size()
            for s in optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )

    def close(self) -> None:
        """Stop background work and remove hooks (a thread handed on is not this one's)."""
        if self.comm is not None:
            self.comm.close()


class GradientExchange(Protocol):
    """The exchange surface of a strategy: what the Engine's step and its components call."""

    updates_during_exchange: bool
    verdict_all_reduces: bool
    local_loss_bad: bool
    codec: Codec
    bytes_sent: int
    bytes_received: int
    param_waits: list[tuple[int, float, float]]

    @property
    def is_trainer(self) -> bool: ...

    def data_parallel(self) -> tuple[int, int]: ...

    def gradient_scale(self) -> float: ...

    def begin_step(self) -> None: ...

    def launch(self, bucket: Bucket) -> None: ...

    def finish(self) -> None: ...

    def inspect_gradients(
        self, want_norm: bool, riders: torch.Tensor | None = None
    ) -> tuple[bool, float | None]: ...

    def scale_gradients(self, factor: float) -> None: ...

    def update(self, optimizer: Optimizer) -> None: ...

    def register_module(self, module: torch.nn.Module) -> None: ...

    def before_backward(self, last: bool) -> None: ...

    def read_module(self, module: torch.nn.Module) -> torch.nn.Module: ...

    def forward_module(self, module: torch.nn.Module) -> torch.nn.Module: ...

    def take_thread_spans(self) -> list[ThreadSpan]: ...

    def sync(self) -> None: ...

    def close(self) -> None: ...


class OptimizerSharding(Protocol):
    """Where a strategy keeps the optimizer's state and how it moves (``params``: trainable)."""

    optimizer_follows_layout: bool

    def adopt_optimizer(self, optimizer: Optimizer, params: Params) -> Optimizer: ...

    def carry_optimizer_state(self, optimizer: Optimizer, params: Params) -> Any: ...

    def rebind_optimizer(self, optimizer: Optimizer, params: Params, carried: Any) -> None: ...

    def optimizer_state_dict(self, optimizer: Optimizer, params: Params) -> dict[str, Any]: ...

    def load_optimizer_state_dict(
        self, optimizer: Optimizer, params: Params, state: dict[str, Any]
    ) -> None: ...

    def optimizer_shards(
        self, optimizer: Optimizer, params: Params
    ) -> tuple[ShardState, Groups]: ...

    def owned_ranges(self, params: Params) -> dict[int, list[tuple[int, int]]]: ...

    def load_optimizer_shards(
        self, optimizer: Optimizer, params: Params, state: ShardState, groups: Groups
    ) -> None: ...

    def optimizer_bytes(self, optimizer: Optimizer) -> int: ...


STRATEGIES: Registry[Strategy] = Registry("exchange strategy")


@dataclass(frozen=True)
class StrategyFactory:
    """Builds a registered strategy and answers for its class before any instance exists."""

    name: str
    cls: type[Strategy]
    config: Any  # the strategy's Config built from its options (None: it takes none)

    def __call__(self, ctx: Context, buckets: list[Bucket], parts: StrategyParts) -> Strategy:
        return self.cls(ctx, buckets, dataclasses.replace(parts, config=self.config))

    def bucket_alignment(self, world_size: int, backend: str, codec: Codec) -> int:
        return self.cls.bucket_alignment(self.config, world_size, backend, codec)

    def check_world(self, world_size: int) -> None:
        self.cls.check_world(self.config, world_size)

    def num_trainers(self, world_size: int) -> int:
        return self.cls.num_trainers(self.config, world_size)

    def messages(self) -> MessageSchedule:
        """The strategy's messages per bucket, for the planner."""
        return self.cls.Messages(self.cls, self.config)

    def sums_whole_buckets(self, codec: Codec) -> bool:
        return self.cls.sums_whole_buckets(self.config, codec)

    def compile_model(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        return self.cls.compile_model(self.config, module)


def strategy_factory(name: str, options: dict[str, Any] | None = None) -> StrategyFactory:
    """The factory of registered strategy ``name`` with its ``options`` (validated here)."""
    cls = cast("type[Strategy]", STRATEGIES.get(name))  # registered classes
    return StrategyFactory(name, cls, strategy_config(name, options or {}))


def local_tensor(t: Any) -> torch.Tensor:
    """This rank's part of a DTensor (the tensor itself otherwise)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _per_element(value: Any, p: torch.Tensor) -> bool:
    """Whether an optimizer state value has one element per parameter element."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.shape
