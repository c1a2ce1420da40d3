"""``partitioned``: reduce each partition to its owner, update there, send it back (F4, F5).
Schedules ``cyclic`` and ``native``, and why native is not Gloo's reduce_scatter: docs/exchange.md.

Phases per bucket (the Engine's step numbers, as in phalanx.exchange.base):
  Phase 2 (launch): reduce every partition to its owner, a job on the communication thread.
  Phase 4 (finish): wait until every owned partition is reduced (usage flags: in the verdict).
  Phase 5 (update): owners step their partitions, then send them back in the background.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from phalanx.exchange import messages as schedule
from phalanx.exchange.base import STRATEGIES, StrategyParts, holds_nonfinite, stamp_done
from phalanx.exchange.buckets import Bucket
from phalanx.exchange.comm import global_rank
from phalanx.exchange.compression import Codec
from phalanx.exchange.messages import (
    FORWARD_PASS,
    MessageSchedule,
    Phase,
    cyclic_rounds,
    ring_rounds,
)
from phalanx.exchange.owners import OwnerUpdateStrategy
from phalanx.exchange.ring import ring_reduce_scatter
from phalanx.exchange.sharding import Optimizer, ShardedParameters, bounds, used_flags
from phalanx.fields import option
from phalanx.runtime.context import Context

if TYPE_CHECKING:
    from phalanx.exchange.messages import WireCodec

Count = Callable[[int, int], None]  # (bytes sent, bytes received) of this rank


@dataclass(frozen=True)
class Layout:
    """Partitions of one bucket's flat buffer: ``ranges[m]`` = [start, end) of ``owners[m]``."""

    ranges: list[tuple[int, int]]
    owners: list[int]


class PartitionSchedule(ABC):
    """How a bucket's partitions reach their owners and back (1-D, the bucket's dtype, device)."""

    def __init__(self, rank: int, world_size: int, group: Any, codec: Codec) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.codec = codec  # compresses gradient messages; parameters always travel exact

    def alignment(self) -> int:
        return 1

    @abstractmethod
    def layout(self, numel: int) -> Layout: ...

    @abstractmethod
    def reduce(self, flat: torch.Tensor, layout: Layout, count: Count) -> tuple[torch.Tensor, int]:
        """Sum ``flat`` into this rank's partitions; returns (buffer, flat index of its 0)."""

    @abstractmethod
    def send_back(self, flat: torch.Tensor, layout: Layout) -> None:
        """Copy every owner's partitions of ``flat`` (parameters) to every rank."""

    @abstractmethod
    def send_back_bytes(self, layout: Layout, itemsize: int) -> tuple[int, int]:
        """(sent, received) bytes of this rank's part of ``send_back``."""


class CyclicSchedule(PartitionSchedule):
    """The documents' schedule: floor(p/2) partitions, owners 2m, p-1 half-duplex cycles."""

    def layout(self, numel: int) -> Layout:
        n = schedule.num_partitions(self.world_size)
        owners = [schedule.owner(m, self.world_size) for m in range(n)]
        return Layout(bounds(numel, n), owners)

    def reduce(self, flat: torch.Tensor, layout: Layout, count: Count) -> tuple[torch.Tensor, int]:
        for cycle in schedule.reduce_cycles(self.world_size):
            for t in cycle:
                lo, hi = layout.ranges[t.partition]
                if t.src == self.rank:
                    count(self.codec.send(flat[lo:hi], t.dst, self.group), 0)
                elif t.dst == self.rank:
                    count(0, self.codec.recv_add(flat[lo:hi], t.src, self.group))
        return flat, 0

    def send_back(self, flat: torch.Tensor, layout: Layout) -> None:
        for cycle in schedule.broadcast_cycles(self.world_size):
            for t in cycle:
                lo, hi = layout.ranges[t.partition]
                if t.src == self.rank:
                    dist.send(flat[lo:hi], global_rank(self.group, t.dst), group=self.group)
                elif t.dst == self.rank:
                    dist.recv(flat[lo:hi], global_rank(self.group, t.src), group=self.group)

    def send_back_bytes(self, layout: Layout, itemsize: int) -> tuple[int, int]:
        sent = received = 0
        for cycle in schedule.broadcast_cycles(self.world_size):
            for t in cycle:
                lo, hi = layout.ranges[t.partition]
                sent += (hi - lo) * itemsize if t.src == self.rank else 0
                received += (hi - lo) * itemsize if t.dst == self.rank else 0
        return sent, received


class RingSchedule(PartitionSchedule):
    """p partitions (rank r owns r): full-duplex ring reduce-scatter, then a broadcast per owner."""

    def layout(self, numel: int) -> Layout:
        return Layout(bounds(numel, self.world_size), list(range(self.world_size)))

    def reduce(self, flat: torch.Tensor, layout: Layout, count: Count) -> tuple[torch.Tensor, int]:
        ranges, p = layout.ranges, self.world_size
        count(*ring_reduce_scatter(flat, ranges, self.rank, p, self.group, self.codec))
        return flat, 0

    def send_back(self, flat: torch.Tensor, layout: Layout) -> None:
        for (lo, hi), owner in zip(layout.ranges, layout.owners):
            dist.broadcast(flat[lo:hi], owner, group=self.group)

    def send_back_bytes(self, layout: Layout, itemsize: int) -> tuple[int, int]:
        """Counted as the owner sending its partition to each of the p-1 others."""
        sent = received = 0
        for (lo, hi), owner in zip(layout.ranges, layout.owners):
            size = (hi - lo) * itemsize
            sent += size * (self.world_size - 1) if owner == self.rank else 0
            received += size if owner != self.rank else 0
        return sent, received


class CollectiveSchedule(PartitionSchedule):
    """p equal partitions: the backend's reduce_scatter and all_gather (fast on NCCL)."""

    def alignment(self) -> int:
        return self.world_size

    def layout(self, numel: int) -> Layout:
        assert numel % self.world_size == 0, "buckets are padded to a multiple of p"
        return Layout(bounds(numel, self.world_size), list(range(self.world_size)))

    def reduce(self, flat: torch.Tensor, layout: Layout, count: Count) -> tuple[torch.Tensor, int]:
        out = flat.new_empty(flat.numel() // self.world_size)
        dist.reduce_scatter_tensor(out, flat, group=self.group)
        count(out.nbytes * (self.world_size - 1), out.nbytes * (self.world_size - 1))
        return out, layout.ranges[self.rank][0]

    def send_back(self, flat: torch.Tensor, layout: Layout) -> None:
        lo, hi = layout.ranges[self.rank]
        dist.all_gather_into_tensor(flat, flat[lo:hi].clone(), group=self.group)

    def send_back_bytes(self, layout: Layout, itemsize: int) -> tuple[int, int]:
        lo, hi = layout.ranges[self.rank]
        size = (hi - lo) * itemsize * (self.world_size - 1)
        return size, size


@dataclass(kw_only=True)
class PartitionedConfig:
    """Options of the partitioned exchange."""

    schedule: Literal["cyclic", "native"] = option(
        "cyclic", "cyclic: the documents' ring schedule; native: the backend's fastest primitives"
    )


class PartitionedSchedule(MessageSchedule):
    """Reduce each partition to its owner, which updates it and sends it back during forward."""

    config: PartitionedConfig

    def describe(self) -> str:
        return f"partitioned ({self.config.schedule})"

    def bucket_phases(self, world: int, codec: WireCodec, nbytes: float) -> list[Phase]:
        if world < 2:
            return []
        if self.config.schedule == "cyclic":
            return [Phase("reduce", cyclic_rounds(world, False))]
        return [Phase("reduce-scatter", ring_rounds(world, reduce=True, gather=False))]

    def optimizer_fraction(self, world: int) -> float:
        cyclic = self.config.schedule == "cyclic"
        return 1.0 / (schedule.num_partitions(world) if cyclic else world)

    def return_phases(self, world: int) -> list[Phase]:
        if world < 2:
            return []
        if self.config.schedule == "cyclic":
            return [Phase("send-back", cyclic_rounds(world, True), gates=FORWARD_PASS)]
        table = ring_rounds(world, reduce=False, gather=True, grad=False)
        return [Phase("all-gather", table, gates=FORWARD_PASS)]


@STRATEGIES.register("partitioned")
class Partitioned(OwnerUpdateStrategy):
    """Owner-update exchange over partitions of every bucket."""

    Config = PartitionedConfig
    Messages = PartitionedSchedule
    verdict_all_reduces = True

    def __init__(self, ctx: Context, buckets: list[Bucket], parts: StrategyParts) -> None:
        super().__init__(ctx, buckets, parts)
        self.config = parts.config or PartitionedConfig()
        plan_class = _schedule_class(self.config, ctx.backend, self.codec.wire_dtype is not None)
        self.plan = plan_class(ctx.rank, ctx.world_size, self.comm_thread().group, self.codec)
        self.layouts: list[Layout] = [self.plan.layout(b.flat.numel()) for b in buckets]
        ranges = [lay.ranges for lay in self.layouts]
        owners = [lay.owners for lay in self.layouts]
        self.sharded = ShardedParameters(buckets, ranges, owners, ctx.rank, group_of=self.group_of)
        self._pending_reduce: dict[int, Any] = {}
        self._reduced: dict[int, tuple[torch.Tensor, int]] = {}
        self._flag_base = [0]  # per bucket, where its usage flags sit in the usage message
        for bucket in buckets[:-1]:
            self._flag_base.append(self._flag_base[-1] + len(bucket.params))
        self._used: list[list[bool]] | None = None  # this step's, per bucket and parameter

    @classmethod
    def bucket_alignment(cls, config: Any, world_size: int, backend: str, codec: Codec) -> int:
        config = config or PartitionedConfig()
        plan_class = _schedule_class(config, backend, codec.wire_dtype is not None)
        return world_size if plan_class is CollectiveSchedule else 1

    def launch(self, bucket: Bucket) -> None:
        comm = self.comm_thread()
        self._wait_params(bucket.index)  # its parameters must have arrived before they change
        layout, plan = self.layouts[bucket.index], self.plan
        job = stamp_done(
            bucket, comm.submit(lambda: plan.reduce(bucket.flat, layout, self.count_bytes))
        )
        self._pending_reduce[bucket.index] = job

    def finish(self) -> None:
        self._reduced = {
            b: self._pending_reduce.pop(b).result() for b in sorted(self._pending_reduce)
        }
        self._used = None

    def inspect_gradients(
        self, want_norm: bool, riders: torch.Tensor | None = None
    ) -> tuple[bool, float | None]:
        """Owners check their partitions (and sum squares: one float64 pass, 0.75 -> 0.15 ms); one
        all-reduce makes both global, with ``riders`` and the summed usage flags."""
        num_riders = 0 if riders is None else riders.numel()
        usage = self._owned_usage()
        local = usage.new_zeros(2 + num_riders + usage.numel())
        if riders is not None:
            local[2 : 2 + num_riders] = riders
        local[2 + num_riders :] = usage
        grads, flags = self._owned_partitions()
        if want_norm and grads:
            norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads])
            local[1] = norms.square().sum()
            grads = [local[1:2]]  # inf/NaN in any gradient made the sum inf/NaN
        local[0] = float(holds_nonfinite(grads + flags))
        dist.all_reduce(local, group=self.ctx.group)
        if riders is not None:
            riders.copy_(local[2 : 2 + num_riders])
        self._used = self._usage_of(local[2 + num_riders :])
        return bool(local[0].item() > 0), (float(local[1].sqrt()) if want_norm else None)

    def _owned_ranges(self) -> Iterator[tuple[Bucket, int, torch.Tensor]]:
        """(bucket, flat start, reduced 1-D view) of each partition this rank reduced."""
        for b, (buffer, offset) in self._reduced.items():
            layout = self.layouts[b]
            for (lo, hi), owner in zip(layout.ranges, layout.owners):
                if owner == self.ctx.rank and hi > lo:
                    yield self.sharded.buckets[b], lo, buffer[lo - offset : hi - offset]

    def _owned_usage(self) -> torch.Tensor:
        """Every bucket's usage flags (float64, per parameter): the summed ones this rank owns."""
        total = self._flag_base[-1] + len(self.buckets[-1].params) if self.buckets else 0
        usage = torch.zeros(total, dtype=torch.float64, device=self.ctx.device)
        for bucket, lo, view in self._owned_ranges():
            first = bucket.grads.numel()  # the flags follow the gradients
            a, b = max(lo, first), min(lo + view.numel(), first + len(bucket.params))
            if a < b:
                base = self._flag_base[bucket.index] - first
                usage[base + a : base + b] = view[a - lo : b - lo]
        return usage

    def _usage_of(self, summed: torch.Tensor) -> list[list[bool]]:
        """Per bucket and parameter, whether any rank used it (``summed``: ``_owned_usage``'s)."""
        return [
            used_flags(summed[base : base + len(bucket.params)])
            for base, bucket in zip(self._flag_base, self.buckets)
        ]

    def _owned_partitions(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The owned partitions' views cut in two: (gradients, usage flags)."""
        grads: list[torch.Tensor] = []
        flags: list[torch.Tensor] = []
        for bucket, lo, view in self._owned_ranges():
            split = min(max(0, bucket.grads.numel() - lo), view.numel())  # flags begin here
            grads += [view[:split]] if split > 0 else []
            flags += [view[split:]] if split < view.numel() else []
        return grads, flags

    def scale_gradients(self, factor: float) -> None:
        for grad in self._owned_grads():
            grad.mul_(factor)

    def _owned_grads(self) -> list[torch.Tensor]:
        """This rank's shards' reduced gradients (views; usage flags and padding excluded)."""
        out = []
        for shard in self.sharded.shards:
            buffer, offset = self._reduced[shard.bucket]
            out.append(buffer[shard.start - offset : shard.end - offset])
        return out

    def update(self, optimizer: Optimizer) -> None:
        if self._used is None:  # no verdict this step (the Engine has no guard): agree here
            usage = self._owned_usage()
            dist.all_reduce(usage, group=self.ctx.group)
            self._used = self._usage_of(usage)
        grads = {b: buffer for b, (buffer, _) in self._reduced.items()}
        offsets = {b: offset for b, (_, offset) in self._reduced.items()}
        self.sharded.attach_grads(grads, offsets, self._used)
        optimizer.step()
        # Forward needs the buckets in the reverse of backward's order: send those back first.
        for bucket in reversed(self.sharded.buckets):
            self._pending_params[bucket.index] = self._send_back(bucket.index)
        self._reduced = {}

    def _send_back(self, b: int) -> Any:
        flat, layout, plan = self.sharded.flats[b], self.layouts[b], self.plan
        self.count_bytes(*plan.send_back_bytes(layout, flat.element_size()))
        return self.comm_thread().submit(lambda: plan.send_back(flat, layout))


def _schedule_class(
    config: PartitionedConfig, backend: str, compressed: bool
) -> type[PartitionSchedule]:
    """The schedule of ``config`` on ``backend`` (compressed: never a backend collective)."""
    if config.schedule == "cyclic":
        return CyclicSchedule
    return CollectiveSchedule if backend == "nccl" and not compressed else RingSchedule
