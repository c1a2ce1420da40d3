"""Each exchange strategy's message schedule for one bucket, as rounds of point-to-point messages.

A ``Schedule`` (registered by name in ``SCHEDULES``, the names of phalanx's strategies plus
``ring``) says, for one bucket of n bytes on P ranks, which messages travel in which order. Its
work comes in ``Phase``s that the simulator (sim.py) runs one after another on the
communication stream:
  Phase 1 (``bucket_phases``): as soon as the bucket is launched during backward: the
    allreduce, the reduce to the owners, or the push / server update / pull of a parameter
    server. Each phase says whether the step waits for it (``gates = STEP``) or only the next
    forward of the bucket's layers (``gates = FORWARD``: the pull of ``ps``).
  Phase 2 (``optimizer_fraction``): after backward and every STEP phase, the optimizer runs on
    the compute stream over this fraction of the gradients (1: replicated; 1/owners: sharded).
  Phase 3 (``return_phases``): owners send the updated parameters back, bucket after bucket in
    forward order, while the next forward runs (``partitioned``'s send-back: ``gates =
    FORWARD``, each layer waits for its own bucket), or before it starts (``gates = STEP``).
A strategy that shards the parameters themselves (``fsdp``) has no buckets: its
``unit_phases`` say what it communicates around each unit's compute (one unit per layer: an
all-gather before the unit's forward and, resharded, before its backward; a reduce-scatter
after its backward), and the optimizer runs on 1/P. ``Phase.scale`` converts a unit's float32
bytes into the bytes a phase moves (mixed precision).

Rounds are in each rank's program order: a rank takes part in the rounds that name it, one
after another, and its messages within one round run at the same time (a ring step sends and
receives at once). Sizes are fractions of the bucket (a ``RoundTable`` holds them as arrays, so
one table serves every bucket size), and each message has a ``kind``: ``GRAD`` (a gradient,
compressed on the wire and coded at both ends), ``FORWARD`` (already compressed, passed on:
decoded only) or ``PARAM`` (parameters: always exact).

``WIRE_CODECS`` models compression: ``fp16``/``bf16`` halve a gradient's bytes, add the scale
(4 bytes) to each message, and cost ``ClusterConfig.codec_s_per_byte`` per uncompressed byte.
Nothing outside these registries branches on a strategy's or codec's name.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from phalanx.errors import ConfigError
from phalanx.exchange import schedule as cyclic
from phalanx.exchange.base import strategy_config
from phalanx.exchange.compression import SCALE_BYTES
from phalanx.exchange.fsdp import DTYPES, FsdpConfig
from phalanx.exchange.param_server import star_turn
from phalanx.exchange.ring import GATHER_MAX_BYTES
from phalanx.exchange.tree import tree_parent
from phalanx.fields import ConfigValueError
from phalanx.registry import Registry

GRAD, FORWARD, PARAM = 0, 1, 2  # message kinds (indices into WireCodec's tables)
KIND_NAMES = ("grad", "forward", "param")
STEP, FORWARD_PASS = "step", "forward"  # what waits for a phase


@dataclass(frozen=True)
class Message:
    """``nbytes`` (uncompressed) travel from rank ``src`` to rank ``dst``."""

    src: int
    dst: int
    nbytes: float
    kind: int = GRAD


@dataclass(frozen=True, eq=False)
class RoundTable:
    """The messages of one phase, as arrays in program order; round r holds messages
    ``starts[r]:starts[r+1]``. ``fraction``: each message's share of the bucket's bytes.
    ``summed``: whether phalanx's receiver adds the message into its buffer (a point-to-point
    reduction; not the backend's own allreduce, whose adds its calibration includes).
    ``key`` identifies the table (for caches): equal keys, equal tables."""

    key: tuple
    src: np.ndarray
    dst: np.ndarray
    fraction: np.ndarray
    kind: np.ndarray
    starts: np.ndarray
    summed: np.ndarray

    @property
    def num_rounds(self) -> int:
        return len(self.starts) - 1

    @property
    def num_messages(self) -> int:
        return len(self.src)

    def rounds(self, nbytes: float) -> list[list[Message]]:
        """The rounds with the message sizes of a bucket of ``nbytes`` bytes."""
        out = []
        for r in range(self.num_rounds):
            lo, hi = int(self.starts[r]), int(self.starts[r + 1])
            out.append(
                [
                    Message(int(s), int(d), float(f) * nbytes, int(k))
                    for s, d, f, k in zip(
                        self.src[lo:hi], self.dst[lo:hi], self.fraction[lo:hi], self.kind[lo:hi]
                    )
                ]
            )
        return out


class _Builder:
    """Collects rounds of (src, dst, fraction, kind) into a RoundTable. ``summed`` of a round:
    whether its receivers add what arrives (default: gradients do, ``kind == GRAD``)."""

    def __init__(self) -> None:
        # (5, m) blocks of src, dst, fraction, kind, summed
        self.chunks: list[np.ndarray] = []
        self.sizes: list[int] = []  # messages per round

    def round(
        self, messages: Iterable[tuple[int, int, float, int]], summed: bool | None = None
    ) -> None:
        """Append one round (skipped if empty)."""
        block = np.asarray(list(messages), dtype=np.float64).reshape(-1, 4).T
        if block.shape[1]:
            self._append(block, summed, [block.shape[1]])

    def rounds(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        fraction: float,
        kind: int,
        count: int,
        summed: bool | None = None,
    ) -> None:
        """Append ``count`` rounds, each of the messages src[i] -> dst[i]."""
        m = len(src)
        block = np.empty((4, m * count))
        block[0], block[1] = np.tile(src, count), np.tile(dst, count)
        block[2], block[3] = fraction, kind
        self._append(block, summed, [m] * count)

    def singles(self, src: np.ndarray, dst: np.ndarray, fraction: float, kind: int) -> None:
        """Append one round per message src[i] -> dst[i], in order."""
        block = np.empty((4, len(src)))
        block[0], block[1], block[2], block[3] = src, dst, fraction, kind
        self._append(block, None, [1] * len(src))

    def _append(self, block: np.ndarray, summed: bool | None, sizes: list[int]) -> None:
        flags = block[3] == GRAD if summed is None else np.full(block.shape[1], summed)
        self.chunks.append(np.vstack([block, flags]))
        self.sizes.extend(sizes)

    def table(self, key: tuple) -> RoundTable:
        data = np.concatenate(self.chunks, axis=1) if self.chunks else np.zeros((5, 0))
        return RoundTable(
            key=key,
            src=data[0].astype(np.int64),
            dst=data[1].astype(np.int64),
            fraction=data[2].copy(),
            kind=data[3].astype(np.int64),
            starts=np.concatenate(([0], np.cumsum(self.sizes, dtype=np.int64))),
            summed=data[4].astype(bool),
        )


@dataclass(frozen=True)
class Phase:
    """One step of a bucket's exchange on the communication stream: messages (``table``) or,
    when ``table`` is None, an owner's optimizer update of ``update_fraction`` of the bucket."""

    name: str
    table: RoundTable | None = None
    update_fraction: float = 0.0
    gates: str = STEP
    # bytes moved per byte of the bucket (or unit): mixed precision's all-gather moves
    # param_dtype, its reduce-scatter reduce_dtype, of float32 parameters and gradients
    scale: float = 1.0


@dataclass(frozen=True)
class UnitPhases:
    """What a strategy that shards parameters per unit (``fsdp``: one unit per layer)
    communicates around each unit's compute, instead of fusion buckets after it (sim.py):
    ``gather`` before the unit's forward and ``regather`` before its backward (its parameters,
    all-gathered; ``regather`` empty when they stay gathered from forward to backward), each
    issued ``prefetch`` units ahead so that it overlaps the compute of the units before it;
    ``reduce`` after the unit's backward (its gradients, reduce-scattered), overlapping the
    next units' backward. Sizes: the unit's float32 bytes times each phase's ``scale``."""

    gather: list[Phase]
    regather: list[Phase]
    reduce: list[Phase]
    prefetch: int

    @property
    def phases(self) -> list[Phase]:
        return self.gather + self.regather + self.reduce


# -- the rounds of the algorithms ----------------------------------------------------------------
def _shares(num_parts: int) -> list[float]:
    """Near-equal shares of a bucket split in ``num_parts`` (as ``sharding.bounds`` splits)."""
    return [1.0 / num_parts] * num_parts


@functools.lru_cache(maxsize=64)
def ring_rounds(
    world: int,
    reduce: bool = True,
    gather: bool = True,
    grad: bool = True,
    backend: bool = False,
) -> RoundTable:
    """Ring reduce-scatter (p-1 steps) then all-gather (p-1 steps): in every step each rank
    sends 1/p of the bucket to rank+1 while receiving 1/p from rank-1 (F14). ``grad`` False:
    the all-gather carries parameters (exact); True: the owners' encoded chunks (FORWARD).
    ``backend``: the backend's own allreduce, whose adds the link's calibration includes (not
    ``summed``); else phalanx's point-to-point ring, which adds each arriving chunk itself."""
    b = _Builder()
    ranks = np.arange(world)
    if reduce:
        summed = False if backend else None
        b.rounds(ranks, (ranks + 1) % world, 1.0 / world, GRAD, world - 1, summed=summed)
    if gather:
        b.rounds(ranks, (ranks + 1) % world, 1.0 / world, FORWARD if grad else PARAM, world - 1)
    return b.table(("ring", world, reduce, gather, grad, backend))


@functools.lru_cache(maxsize=64)
def gather_rounds(world: int) -> RoundTable:
    """Every rank sends its whole message to every other rank in one round (phalanx's gather
    for small compressed buckets at p = 2, exchange/ring.py)."""
    b = _Builder()
    b.round((s, d, 1.0, GRAD) for s in range(world) for d in range(world) if s != d)
    return b.table(("gather", world))


def _tree_up(ranks: list[int], share: float, b: _Builder) -> None:
    """Binary-tree reduction to ranks[0] over positions 0..n-1 (phalanx.exchange.tree): in
    round s, position i whose lowest set bit is s sends its partial sum to i - 2^s."""
    n = len(ranks)
    depth = math.ceil(math.log2(n)) if n > 1 else 0
    for s in range(depth):
        b.round(
            (ranks[i], ranks[cast(int, tree_parent(i))], share, GRAD)  # i >= 1: not the root
            for i in range(1, n)
            if (i & -i) == 1 << s
        )


def _tree_down(
    ranks: list[int], share: float, kind: int, b: _Builder, passed_on: int | None = None
) -> None:
    """Back down the same tree: each position forwards what it received to its children,
    farthest first (a binomial broadcast from ranks[0], ceil(log2 n) rounds). ``kind``: the
    first round's messages; ``passed_on`` (default ``kind``): the later rounds', whose message
    the sender already holds in wire form (the root's encoding, sent again or forwarded)."""
    n = len(ranks)
    depth = math.ceil(math.log2(n)) if n > 1 else 0
    for t in range(depth):
        step = 1 << (depth - 1 - t)
        b.round(
            (
                (
                    ranks[i],
                    ranks[i + step],
                    share,
                    kind if t == 0 or passed_on is None else passed_on,
                )
                for i in range(0, n, 2 * step)
                if i + step < n  # i + step is i's child: i's lowest set bit is above step
            ),
            summed=False,  # the result: stored, not added
        )


@functools.lru_cache(maxsize=64)
def tree_rounds(world: int) -> RoundTable:
    """The ``tree`` strategy: reduce to rank 0 up a binary tree, then back down (F9)."""
    b = _Builder()
    ranks = list(range(world))
    _tree_up(ranks, 1.0, b)
    # the root encodes the sum once (GRAD: encoded there, decoded at the child); every later
    # message is that encoding passed on (FORWARD: decoded only), as tree_allreduce sends it
    _tree_down(ranks, 1.0, GRAD, b, passed_on=FORWARD)
    return b.table(("tree", world))


@functools.lru_cache(maxsize=64)
def cyclic_rounds(world: int, send_back: bool) -> RoundTable:
    """The documents' cyclic schedule (F4, phalanx.exchange.schedule): p-1 half-duplex cycles
    in which floor(p/2) partitions each hop one rank; reduce, or the send-back of parameters.
    Cycle k moves partition m from (2m+k+1) to (2m+k+2) mod p (send-back: (2m+k) to
    (2m+k+1)); built with arrays, the same transfers as ``reduce_cycles``/``broadcast_cycles``
    (a unit test compares them), because those build one object per transfer."""
    b = _Builder()
    parts = np.arange(cyclic.num_partitions(world))
    share = 1.0 / len(parts)
    offset = 0 if send_back else 1
    for k in range(world - 1):
        src = (2 * parts + k + offset) % world
        b.rounds(src, (src + 1) % world, share, PARAM if send_back else GRAD, 1)
    return b.table(("cyclic", world, send_back))


@functools.lru_cache(maxsize=64)
def ps_rounds(
    world: int, owners: tuple[int, ...], workers: tuple[int, ...], reduce: str, pull: bool
) -> RoundTable:
    """Parameter-server push (or pull) of one bucket (phalanx.exchange.param_server): star:
    one round, every worker sending each partition to its server at once (pull: every server
    to every worker), in ``star_turn`` order; tree: partition by partition in owner order, up
    (or down) a binary tree rooted at the owner."""
    b = _Builder()
    share = 1.0 / len(owners)
    if reduce != "tree":
        pairs = sorted(
            ((owner, w) for owner in owners for w in workers if w != owner),
            key=lambda pair: (star_turn(owners.index(pair[0]), pair[1], len(owners)), pair[1]),
        )
        kind = PARAM if pull else GRAD
        b.round(((o, w, share, kind) if pull else (w, o, share, kind)) for o, w in pairs)
        return b.table(("ps", world, owners, workers, reduce, pull))
    for owner in owners:
        ranks = [owner] + [w for w in workers if w != owner]
        if pull:
            _tree_down(ranks, share, PARAM, b)
        else:
            _tree_up(ranks, share, b)
    return b.table(("ps", world, owners, workers, reduce, pull))


# -- the schedules ---------------------------------------------------------------------------
class Schedule(ABC):
    """One strategy's messages per bucket (see the module docstring for the phases).

    ``agrees_before_backward``: the strategy updates while gradients arrive, so the Engine's
    non-finite guard agrees on every rank's loss first, in one 1-element allreduce between the
    last forward and its backward (phalanx.engine): a synchronisation of the compute stream."""

    agrees_before_backward = False
    # the Engine's global loss rides in the strategy's verdict all-reduce (no message of its
    # own); False: its own 1-element all-reduce runs beside backward (phalanx.engine.global_loss)
    loss_rides_verdict = False
    # whether ``phalanx plan`` sweeps it by default (``ring``, ``tree_ps``: models of other
    # systems, planned when asked for)
    models_strategy = True
    # what replaces the fusion threshold for a strategy that exchanges per unit (``fsdp``:
    # one unit per layer); None: buckets formed by the threshold
    unit_label: str | None = None

    def loss_rides(self, codec: WireCodec) -> bool:
        """Whether the Engine's global loss travels in a message the step makes anyway (the
        verdict's all-reduce; the last bucket where whole buckets are summed uncompressed)."""
        del codec
        return self.loss_rides_verdict

    def check_world(self, world: int) -> None:
        """One-line ConfigError if this schedule cannot run on ``world`` ranks."""
        del world

    def num_trainers(self, world: int) -> int:
        """Ranks that run forward and backward (the others are dedicated servers)."""
        return world

    @abstractmethod
    def bucket_phases(self, world: int, codec: WireCodec, nbytes: float) -> list[Phase]:
        """Phase 1: what runs when a bucket of ``nbytes`` bytes is launched."""

    def optimizer_fraction(self, world: int) -> float:
        """Phase 2: the share of the gradients the busiest rank's optimizer updates."""
        del world
        return 1.0

    def return_phases(self, world: int) -> list[Phase]:
        """Phase 3: per bucket, after the optimizer, overlapping the next forward."""
        del world
        return []

    def unit_phases(
        self, world: int, reduce_scatter_all_reduces: bool = False
    ) -> UnitPhases | None:
        """A strategy that shards parameters per unit (one layer's parameters): what it
        communicates around each unit's compute instead of ``bucket_phases``. None: buckets."""
        del world
        return None

    def refuses(self, codec: WireCodec) -> str | None:
        """Why this strategy cannot run with ``codec`` (None: it can): a sentence for
        ``exchange.compress``'s one-line error and the plan's note."""
        del codec
        return None

    def on_thread(self, codec: WireCodec, last: bool) -> bool:
        """Whether a bucket's exchange (``last``: the step's last bucket) and the send-back run
        as jobs on phalanx's communication thread, handed over from the compute thread: each
        hand-over to a sleeping thread, and each wait that ends with such a job, costs the
        cluster's ``handoff_s``. True for phalanx's point-to-point strategies."""
        del codec, last
        return True

    def describe(self) -> str:
        return type(self).__name__


SCHEDULES: Registry[Schedule] = Registry("exchange schedule")


def agreement_phases(world: int) -> list[Phase]:
    """The non-finite guard's agreement (``Schedule.agrees_before_backward``): a 1-element
    allreduce, as the backend's ring (4 bytes: its rounds' latency)."""
    return [Phase("agree", ring_rounds(world, backend=True))] if world > 1 else []


def _strategy_options(name: str, options: dict[str, Any] | None) -> Any:
    """The phalanx strategy's own Config for ``options`` (same keys, same one-line errors)."""

    try:
        return strategy_config(name, dict(options or {}))
    except ConfigValueError as e:
        raise ConfigError(f"exchange.{e.key}: {e.reason}") from None


@SCHEDULES.register("allreduce")
class AllReduceSchedule(Schedule):
    """The backend's ring allreduce; compressed: phalanx's point-to-point ring, or the
    one-round gather at p = 2 for messages up to 2 MiB (exchange/ring.py)."""

    def __init__(self, **options: Any) -> None:
        _strategy_options("allreduce", options)

    def bucket_phases(self, world: int, codec: WireCodec, nbytes: float) -> list[Phase]:
        if world < 2:
            return []
        if codec.compresses and world == 2 and codec.wire_bytes(nbytes) <= GATHER_MAX_BYTES:
            return [Phase("gather", gather_rounds(world))]
        # uncompressed: the backend's allreduce; compressed: phalanx's ring
        return [Phase("allreduce", ring_rounds(world, backend=not codec.compresses))]

    def on_thread(self, codec: WireCodec, last: bool) -> bool:
        # uncompressed: the backend's own collectives; compressed: the thread, except the
        # last bucket, which the compute thread exchanges itself (exchange/allreduce.py)
        return codec.compresses and not last

    def loss_rides(self, codec: WireCodec) -> bool:
        return not codec.compresses  # in the last bucket's rider slots (phalanx.engine.global_loss)


@SCHEDULES.register("ring")
class RingSchedule(Schedule):
    """phalanx's point-to-point ring (exchange/ring.py) for every bucket: 2(p-1) steps."""

    models_strategy = False  # the transport of compressed ``allreduce``, not a strategy

    def bucket_phases(self, world: int, codec: WireCodec, nbytes: float) -> list[Phase]:
        return [Phase("ring", ring_rounds(world))] if world > 1 else []

    def on_thread(self, codec: WireCodec, last: bool) -> bool:
        return not last  # as compressed ``allreduce`` runs it


@SCHEDULES.register("tree")
class TreeSchedule(Schedule):
    """Binary-tree reduce to rank 0 and broadcast back down, the whole bucket per message."""

    def __init__(self, **options: Any) -> None:
        _strategy_options("tree", options)

    def bucket_phases(self, world: int, codec: WireCodec, nbytes: float) -> list[Phase]:
        return [Phase("tree", tree_rounds(world))] if world > 1 else []

    def loss_rides(self, codec: WireCodec) -> bool:
        return not codec.compresses  # in the last bucket's rider slots (phalanx.engine.global_loss)


@SCHEDULES.register("partitioned")
class PartitionedSchedule(Schedule):
    """Reduce each partition to its owner, the owner updates its shard, then sends it back
    while the next forward runs. ``cyclic``: the documents' half-duplex schedule with
    floor(p/2) owners; ``native``: p owners, ring reduce-scatter and all-gather (NCCL)."""

    loss_rides_verdict = True  # the verdict's all-reduce carries the loss

    def __init__(self, **options: Any) -> None:
        self.config = _strategy_options("partitioned", options)

    @property
    def _cyclic(self) -> bool:
        return self.config.schedule == "cyclic"

    def bucket_phases(self, world: int, codec: WireCodec, nbytes: float) -> list[Phase]:
        if world < 2:
            return []
        if self._cyclic:
            return [Phase("reduce", cyclic_rounds(world, False))]
        return [Phase("reduce-scatter", ring_rounds(world, reduce=True, gather=False))]

    def optimizer_fraction(self, world: int) -> float:
        return 1.0 / (cyclic.num_partitions(world) if self._cyclic else world)

    def return_phases(self, world: int) -> list[Phase]:
        if world < 2:
            return []
        if self._cyclic:
            return [Phase("send-back", cyclic_rounds(world, True), gates=FORWARD_PASS)]
        table = ring_rounds(world, reduce=False, gather=True, grad=False)
        return [Phase("all-gather", table, gates=FORWARD_PASS)]

    def describe(self) -> str:
        return f"partitioned ({self.config.schedule})"


@SCHEDULES.register("ps")
class ParameterServerSchedule(Schedule):
    """Per bucket: push each partition to its server, the server updates it, pull it back.
    ``servers = k`` dedicated ranks (the last k; 0: every rank serves one partition);
    ``reduce``: ``star`` (direct messages, incast at the server) or ``tree``."""

    agrees_before_backward = True  # servers update buckets as they arrive

    def __init__(self, **options: Any) -> None:
        self.config = _strategy_options("ps", options)

    def check_world(self, world: int) -> None:
        if self.config.servers >= world:
            raise ConfigError(
                f"exchange.options.servers: {self.config.servers} servers leave no worker on "
                f"{world} devices"
            )

    def _roles(self, world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        servers = self.config.servers
        workers = tuple(range(world - servers))
        owners = tuple(range(world)) if servers == 0 else tuple(range(world - servers, world))
        return owners, workers

    def num_trainers(self, world: int) -> int:
        return world - self.config.servers

    def bucket_phases(self, world: int, codec: WireCodec, nbytes: float) -> list[Phase]:
        owners, workers = self._roles(world)
        reduce = self.config.reduce
        return [
            Phase("push", ps_rounds(world, owners, workers, reduce, False)),
            Phase("update", update_fraction=1.0 / len(owners)),
            Phase("pull", ps_rounds(world, owners, workers, reduce, True), gates=FORWARD_PASS),
        ]

    def optimizer_fraction(self, world: int) -> float:
        return 0.0  # the servers update each bucket as it arrives (the "update" phase)

    def describe(self) -> str:
        return f"ps (servers={self.config.servers}, {self.config.reduce})"


@functools.lru_cache(maxsize=64)
def tree_up_rounds(world: int) -> RoundTable:
    """Only the reduction of ``tree_rounds``: the sum ends at rank 0."""
    b = _Builder()
    _tree_up(list(range(world)), 1.0, b)
    return b.table(("tree_up", world))


@functools.lru_cache(maxsize=64)
def star_rounds(world: int, root: int = 0) -> RoundTable:
    """The root sends the whole bucket (parameters) to every other rank, one after another."""
    b = _Builder()
    others = np.asarray([r for r in range(world) if r != root], dtype=np.int64)
    b.singles(np.full_like(others, root), others, 1.0, PARAM)
    return b.table(("star", world, root))


@SCHEDULES.register("tree_ps")
class TreeServerSchedule(Schedule):
    """The parallel-CNN paper's parameter server (seed 001, Fig. 1 and section 2): each
    layer's gradients are summed up a binary tree to the server (rank 0) while backward runs,
    the server updates that layer, and before the next iteration every replica fetches the
    updated parameters from the server. Not a phalanx strategy: modelled to compare with that
    paper (phalanx's ``tree`` sends the sum back down the tree instead, overlapped)."""

    models_strategy = False

    def bucket_phases(self, world: int, codec: WireCodec, nbytes: float) -> list[Phase]:
        if world < 2:
            return []
        return [Phase("reduce", tree_up_rounds(world)), Phase("update", update_fraction=1.0)]

    def optimizer_fraction(self, world: int) -> float:
        return 0.0 if world > 1 else 1.0

    def return_phases(self, world: int) -> list[Phase]:
        # STEP: the next iteration starts once every replica holds every parameter.
        return [Phase("fetch", star_rounds(world), gates=STEP)] if world > 1 else []

    def on_thread(self, codec: WireCodec, last: bool) -> bool:
        return False  # another system's server (its own threads are not phalanx's)


DTYPE_BYTES = {name: dtype.itemsize for name, dtype in DTYPES.items()}  # fsdp's dtypes
PARAM_DTYPE_BYTES = 4  # the profile's parameters and gradients are float32 (step.py)


def gather_scale(config: FsdpConfig) -> float:
    """All-gathered bytes per float32 parameter byte (``param_dtype``)."""
    return DTYPE_BYTES[config.param_dtype or "float32"] / PARAM_DTYPE_BYTES


def reduce_scale(config: FsdpConfig) -> float:
    """Reduce-scattered bytes per float32 gradient byte (``reduce_dtype``, else
    ``param_dtype``: torch's MixedPrecisionPolicy)."""
    dtype = config.reduce_dtype or config.param_dtype or "float32"
    return DTYPE_BYTES[dtype] / PARAM_DTYPE_BYTES


@SCHEDULES.register("fsdp")
class FullyShardedSchedule(Schedule):
    """Fully sharded data parallel (torch's ``fully_shard``, one unit per layer): each rank
    holds 1/p of every unit's parameters, gradients and optimizer state. Before a unit's
    forward its parameters are all-gathered (ring: p-1 steps of 1/p), ``prefetch`` units
    ahead; with ``reshard_after_forward`` they are freed after it and all-gathered again before
    its backward; after its backward its gradients are reduce-scattered (ring, p-1 steps), and
    the optimizer updates 1/p of the parameters. Nothing is sent back. Per rank and step:
    (p-1)/p of the parameters' bytes per all-gather and of the gradients' per reduce-scatter."""

    loss_rides_verdict = True  # the verdict's all-reduce carries the loss

    unit_label = "per layer"

    def __init__(self, **options: Any) -> None:
        self.config = cast(FsdpConfig, _strategy_options("fsdp", options))

    def bucket_phases(self, world: int, codec: WireCodec, nbytes: float) -> list[Phase]:
        return self.unit_phases(world).reduce  # a unit's gradients (sim.py runs unit_phases)

    def unit_phases(self, world: int, reduce_scatter_all_reduces: bool = False) -> UnitPhases:
        """``reduce_scatter_all_reduces``: the backend reduce-scatters by all-reducing the
        whole tensor, then keeping a slice (Gloo, the CPU ranks' backend; measured on 2 ranks
        here: 1 MB reduce-scatter 1.72 ms, all-reduce 1.34 ms): twice a ring's bytes."""
        c = self.config
        if world < 2:
            return UnitPhases([], [], [], c.prefetch)
        table = ring_rounds(world, reduce=False, gather=True, grad=False)
        gather = Phase("all-gather", table, scale=gather_scale(c))
        regather = Phase("all-gather (backward)", table, scale=gather_scale(c))
        # torch's reduce-scatter: the backend's collective, its adds inside the calibration
        reduce_table = ring_rounds(
            world, reduce=True, gather=reduce_scatter_all_reduces, backend=True
        )
        reduce = Phase("reduce-scatter", reduce_table, scale=reduce_scale(c))
        regathers = [regather] if c.reshard_after_forward else []
        return UnitPhases([gather], regathers, [reduce], c.prefetch)

    def optimizer_fraction(self, world: int) -> float:
        return 1.0 / world  # each rank steps its own shard

    def refuses(self, codec: WireCodec) -> str | None:
        if not codec.compresses:
            return None
        return (
            f"fsdp reduce-scatters gradients in its reduce_dtype, not with {codec.name} "
            "compression (set exchange.options.reduce_dtype instead)"
        )

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


def make_schedule(name: str, options: dict[str, Any] | None = None) -> Schedule:
    """The registered schedule ``name`` with the strategy's ``options``."""
    return SCHEDULES.get(name)(**(options or {}))


# -- compression on the wire ---------------------------------------------------------------------
@dataclass(frozen=True)
class WireCodec:
    """What a codec does to a message of each kind: the wire's bytes per uncompressed byte, the
    bytes added per message, and the coding work in units of ``codec_s_per_byte`` per
    uncompressed byte (1: encode and decode; 0.5: decode only). ``separate_add``: a summed
    message's add costs ``ClusterConfig.add_s_per_byte`` on top (no codec: the receiver adds
    the raw message); a codec's ``codec_s_per_byte`` already includes its decode-and-add."""

    name: str
    ratio: tuple[float, float, float] = (1.0, 1.0, 1.0)  # by kind: GRAD, FORWARD, PARAM
    overhead_bytes: tuple[float, float, float] = (0.0, 0.0, 0.0)
    coding: tuple[float, float, float] = (0.0, 0.0, 0.0)
    separate_add: bool = False

    @property
    def compresses(self) -> bool:
        return self.ratio[GRAD] < 1.0

    def wire_bytes(self, nbytes: float, kind: int = GRAD) -> float:
        return nbytes * self.ratio[kind] + self.overhead_bytes[kind]


WIRE_CODECS: Registry[WireCodec] = Registry("compression")
WIRE_CODECS.register("none")(lambda: WireCodec("none", separate_add=True))


def _half_precision(name: str) -> WireCodec:
    """16-bit gradients with one float32 scale per message (exchange/compression.py)."""

    return WireCodec(
        name,
        ratio=(0.5, 0.5, 1.0),
        overhead_bytes=(SCALE_BYTES, SCALE_BYTES, 0.0),
        coding=(1.0, 0.5, 0.0),
    )


WIRE_CODECS.register("fp16")(lambda: _half_precision("fp16"))
WIRE_CODECS.register("bf16")(lambda: _half_precision("bf16"))


def make_codec(name: str) -> WireCodec:
    return WIRE_CODECS.get(name)()
