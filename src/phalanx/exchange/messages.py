"""The documents' cyclic partition schedule (F4), generalised to any number of ranks, and the
vocabulary in which each strategy states its messages for the planner (``MessageSchedule``).

With p = 2N ranks the source splits the gradients into N partitions. In cycle k (k = 0..p-2)
partition m moves from rank i = (2m+k+1) mod p to rank j = (2m+k+2) mod p, which adds its own
copy: after p-1 cycles partition m has visited every rank and is fully reduced at its owner
2m. The broadcast phase then sends the updated partition m from a = (2m+k) mod p to
b = (2m+k+1) mod p, again p-1 cycles. Partition m's pair in cycle k is {2m+k+1, 2m+k+2};
pairs of different partitions start 2 ranks apart, so within a cycle they are disjoint and
every rank only sends or only receives.

For odd p = 2N+1 the same formulas with N = floor(p/2) partitions keep the pairs disjoint: the
start offsets 1, 3, ..., 2N-1 are at least 2 apart around the ring of p (the wrap-around gap is
3), so one rank idles each cycle. With p = 1 there is one partition and no cycle.
Derivation and cost: docs/exchange.md.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from phalanx.exchange.compression import CODECS, SCALE_BYTES
from phalanx.registry import Registry


@dataclass(frozen=True)
class Transfer:
    """Partition ``partition`` travels from rank ``src`` to rank ``dst`` in one cycle."""

    partition: int
    src: int
    dst: int


def num_partitions(world_size: int) -> int:
    return max(1, world_size // 2)


def owner(partition: int, world_size: int) -> int:
    """The rank where partition m ends the reduce phase: 2m."""
    return (2 * partition) % world_size


def reduce_cycles(world_size: int) -> list[list[Transfer]]:
    """Cycle k's transfers of the reduce phase: i = (2m+k+1) % p -> j = (2m+k+2) % p."""
    p = world_size
    return [
        [Transfer(m, (2 * m + k + 1) % p, (2 * m + k + 2) % p) for m in range(num_partitions(p))]
        for k in range(p - 1)
    ]


def broadcast_cycles(world_size: int) -> list[list[Transfer]]:
    """Cycle k's transfers of the broadcast phase: a = (2m+k) % p -> b = (2m+k+1) % p."""
    p = world_size
    return [
        [Transfer(m, (2 * m + k) % p, (2 * m + k + 1) % p) for m in range(num_partitions(p))]
        for k in range(p - 1)
    ]


# -- the messages of a strategy, as the planner simulates them -------------------------------------
GRAD, FORWARD, PARAM = 0, 1, 2  # message kinds (indices into WireCodec's tables)
KIND_NAMES = ("grad", "forward", "param")
STEP, FORWARD_PASS = "step", "forward"  # what waits for a phase


class Message(NamedTuple):
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
        columns = (self.src, self.dst, self.fraction * nbytes, self.kind)
        return [
            [
                Message(int(s), int(d), float(n), int(k))
                for s, d, n, k in zip(*(c[lo:hi] for c in columns))
            ]
            for lo, hi in zip(self.starts[:-1], self.starts[1:])
        ]


class Builder:
    """Collects rounds of (src, dst, fraction, kind) into a RoundTable. ``summed`` of a round:
    whether its receivers add what arrives (default: gradients do, ``kind == GRAD``)."""

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []  # (5, m) blocks of src, dst, fraction, kind, summed
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
        count: int = 1,
        summed: bool | None = None,
    ) -> None:
        """Append ``count`` rounds, each of the messages src[i] -> dst[i]."""
        block = np.empty((4, len(src) * count))
        block[0], block[1], block[2], block[3] = (
            np.tile(src, count),
            np.tile(dst, count),
            fraction,
            kind,
        )
        self._append(block, summed, [len(src)] * count)

    def _append(self, block: np.ndarray, summed: bool | None, sizes: list[int]) -> None:
        flags = block[3] == GRAD if summed is None else np.full(block.shape[1], summed)
        self.chunks.append(np.vstack([block, flags]))
        self.sizes.extend(sizes)

    def table(self, *key: Any) -> RoundTable:
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


@functools.lru_cache(maxsize=64)
def ring_rounds(
    world: int, reduce: bool = True, gather: bool = True, grad: bool = True, backend: bool = False
) -> RoundTable:
    """Ring reduce-scatter (p-1 steps) then all-gather (p-1 steps): in every step each rank
    sends 1/p of the bucket to rank+1 while receiving 1/p from rank-1 (F14). ``grad`` False:
    the all-gather carries parameters (exact); True: the owners' encoded chunks (FORWARD).
    ``backend``: the backend's own allreduce, whose adds the link's calibration includes (not
    ``summed``); else phalanx's point-to-point ring, which adds each arriving chunk itself."""
    b = Builder()
    ranks = np.arange(world)
    if reduce:
        summed = False if backend else None
        b.rounds(ranks, (ranks + 1) % world, 1.0 / world, GRAD, world - 1, summed)
    if gather:
        b.rounds(ranks, (ranks + 1) % world, 1.0 / world, FORWARD if grad else PARAM, world - 1)
    return b.table("ring", world, reduce, gather, grad, backend)


@functools.lru_cache(maxsize=64)
def cyclic_rounds(world: int, send_back: bool) -> RoundTable:
    """The cyclic schedule above as arrays: p-1 half-duplex cycles in which floor(p/2)
    partitions each hop one rank; reduce, or the send-back of parameters. Cycle k moves
    partition m from (2m+k+1) to (2m+k+2) mod p (send-back: (2m+k) to (2m+k+1)); the same
    transfers as ``reduce_cycles``/``broadcast_cycles`` (a unit test compares them), built
    without one object per transfer."""
    b = Builder()
    parts = np.arange(num_partitions(world))
    for k in range(world - 1):
        src = (2 * parts + k + (0 if send_back else 1)) % world
        b.rounds(src, (src + 1) % world, 1.0 / len(parts), PARAM if send_back else GRAD)
    return b.table("cyclic", world, send_back)


class MessageSchedule(ABC):
    """A strategy's messages per bucket, for the planner's simulator (planner/sim.py), built by
    the strategy class (``Strategy.Messages``) with its options; its work comes in phases run
    one after another on the communication stream:
      Phase 1 (``bucket_phases``): as soon as the bucket is launched during backward: the
        allreduce, the reduce to the owners, or the push / server update / pull of a parameter
        server. Each phase says whether the step waits for it (``gates = STEP``) or only the
        next forward of the bucket's layers (``gates = FORWARD_PASS``: the pull of ``ps``).
      Phase 2 (``optimizer_fraction``): after backward and every STEP phase, the optimizer runs
        on the compute stream over this fraction of the gradients (1: replicated; 1/owners).
      Phase 3 (``return_phases``): owners send the updated parameters back, bucket after bucket
        in forward order, while the next forward runs (``gates = FORWARD_PASS``, each layer
        waits for its own bucket), or before it starts (``gates = STEP``).
    A strategy that shards the parameters themselves (``fsdp``) has no buckets: its
    ``unit_phases`` say what it communicates around each unit's compute.

    Rounds are in each rank's program order: a rank takes part in the rounds that name it, one
    after another, and its messages within one round run at the same time. Sizes are fractions
    of the bucket, and each message has a kind: ``GRAD`` (a gradient, compressed on the wire
    and coded at both ends), ``FORWARD`` (already compressed, passed on: decoded only) or
    ``PARAM`` (parameters: always exact). Roles, world checks, refusals and the loss's ride
    come from the strategy class itself (``strategy``: None for models of other systems)."""

    # whether ``phalanx plan`` sweeps it by default (False: models of other systems)
    models_strategy = True
    # what replaces the fusion threshold for a strategy that exchanges per unit (``fsdp``:
    # one unit per layer); None: buckets formed by the threshold
    unit_label: str | None = None

    def __init__(self, strategy: Any = None, config: Any = None) -> None:
        self.strategy, self.config = strategy, config

    @property
    def agrees_before_backward(self) -> bool:
        """The strategy updates while gradients arrive, so the Engine's non-finite guard agrees
        on every rank's loss first, in one 1-element allreduce between the last forward and its
        backward: a synchronisation of the compute stream."""
        return bool(self.strategy and self.strategy.updates_during_exchange)

    def loss_rides(self, codec: WireCodec) -> bool:
        """Whether the Engine's global loss travels in a message the step makes anyway (the
        verdict's all-reduce; the last bucket where whole buckets are summed uncompressed);
        False: its own 1-element all-reduce runs beside backward."""
        s = self.strategy
        return bool(s) and (
            s.verdict_all_reduces or s.sums_whole_buckets(self.config, CODECS.get(codec.name)())
        )

    def check_world(self, world: int) -> None:
        """One-line ConfigError if the strategy cannot run on ``world`` ranks."""
        if self.strategy:
            self.strategy.check_world(self.config, world)

    def num_trainers(self, world: int) -> int:
        """Ranks that run forward and backward (the others are dedicated servers)."""
        return self.strategy.num_trainers(self.config, world) if self.strategy else world

    def refuses(self, codec: WireCodec) -> str | None:
        """Why this strategy cannot run with ``codec`` (None: it can)."""
        return (
            self.strategy.refuses(self.config, CODECS.get(codec.name)()) if self.strategy else None
        )

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
        del world, reduce_scatter_all_reduces
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
    half = (SCALE_BYTES, SCALE_BYTES, 0.0)
    return WireCodec(name, ratio=(0.5, 0.5, 1.0), overhead_bytes=half, coding=(1.0, 0.5, 0.0))


WIRE_CODECS.register("fp16")(lambda: _half_precision("fp16"))
WIRE_CODECS.register("bf16")(lambda: _half_precision("bf16"))


def make_wire_codec(name: str) -> WireCodec:
    return WIRE_CODECS.get(name)()
