"""The documents' cyclic partition schedule (F4), for any number of ranks, and the vocabulary
in which each strategy states its messages for the planner (``MessageSchedule``).

Cycle k moves partition m from (2m+k+1) to (2m+k+2) mod p; pairs are disjoint, so every rank
only sends or only receives. Derivation, odd p and cost: docs/exchange.md, "The cyclic
partition schedule (F4)".
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


def _cycles(p: int, shift: int) -> list[list[Transfer]]:
    parts = range(num_partitions(p))
    return [
        [Transfer(m, (2 * m + k + shift) % p, (2 * m + k + shift + 1) % p) for m in parts]
        for k in range(p - 1)
    ]


def reduce_cycles(world_size: int) -> list[list[Transfer]]:
    """Cycle k's transfers of the reduce phase: i = (2m+k+1) % p -> j = (2m+k+2) % p."""
    return _cycles(world_size, 1)


def broadcast_cycles(world_size: int) -> list[list[Transfer]]:
    """Cycle k's transfers of the broadcast phase: a = (2m+k) % p -> b = (2m+k+1) % p."""
    return _cycles(world_size, 0)


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
    """One phase's messages in program order (round r: ``starts[r]:starts[r+1]``); ``summed``:
    phalanx's receiver adds it; equal ``key``s, equal tables."""

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
    """Collects rounds of (src, dst, fraction, kind) into a RoundTable."""

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
        n = len(src) * count
        block = np.array([np.tile(src, count), np.tile(dst, count), [fraction] * n, [kind] * n])
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
    """One step of a bucket's exchange: messages, or (``table`` None) an owner's update."""

    name: str
    table: RoundTable | None = None
    update_fraction: float = 0.0
    gates: str = STEP
    scale: float = 1.0  # bytes moved per byte of the bucket (mixed precision: 0.5)


@dataclass(frozen=True)
class UnitPhases:
    """What ``fsdp`` communicates around each unit (sim.py): ``gather``, ``regather`` (empty:
    kept) and ``reduce``, ``prefetch`` units ahead; sizes: float32 bytes x ``scale``."""

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
    """Ring reduce-scatter then all-gather (F14); ``grad`` False: parameters; ``backend``: the
    backend's allreduce (not ``summed``)."""
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
    """``reduce_cycles`` (send-back: ``broadcast_cycles``) as arrays (a test compares them)."""
    b = Builder()
    parts = np.arange(num_partitions(world))
    for k in range(world - 1):
        src = (2 * parts + k + (0 if send_back else 1)) % world
        b.rounds(src, (src + 1) % world, 1.0 / len(parts), PARAM if send_back else GRAD)
    return b.table("cyclic", world, send_back)


class MessageSchedule(ABC):
    """A strategy's messages per bucket for the planner's simulator (planner/sim.py), built by
    ``Strategy.Messages`` with its options; phases run one after another on the comm stream:
      Phase 1 (``bucket_phases``): at launch; each gates the step (STEP) or the next forward.
      Phase 2 (``optimizer_fraction``): the optimizer over this fraction, after every STEP phase.
      Phase 3 (``return_phases``): owners send parameters back, overlapping the next forward.
    Kinds: ``GRAD`` (coded at both ends), ``FORWARD`` (passed on: decoded only), ``PARAM``
    (exact). ``strategy``: the class (None for models of other systems)."""

    models_strategy = True  # ``phalanx plan`` sweeps it by default (False: other systems)
    unit_label: str | None = None  # replaces the fusion threshold (``fsdp``: per layer)

    def __init__(self, strategy: Any = None, config: Any = None) -> None:
        self.strategy, self.config = strategy, config

    @property
    def agrees_before_backward(self) -> bool:
        """The guard agrees on the loss before backward (a 1-element allreduce, a sync)."""
        return bool(self.strategy and self.strategy.updates_during_exchange)

    def loss_rides(self, codec: WireCodec) -> bool:
        """Whether the global loss rides in a message the step makes anyway (else its own)."""
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
        """Per-unit communication instead of ``bucket_phases`` (None: buckets)."""
        del world, reduce_scatter_all_reduces
        return None

    def on_thread(self, codec: WireCodec, last: bool) -> bool:
        """Whether a bucket's exchange runs on the comm thread (a hand-over costs ``handoff_s``)."""
        del codec, last
        return True

    def describe(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class WireCodec:
    """A codec's wire bytes per byte and per message, and coding work (``codec_s_per_byte``s)
    by kind; ``separate_add``: adds cost ``ClusterConfig.add_s_per_byte`` on top."""

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
