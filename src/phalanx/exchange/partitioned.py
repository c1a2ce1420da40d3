"""``partitioned``: reduce each partition to its owner, update there, send it back (F4, F5).

Phases per bucket:
  Phase 1 (launch, during backward): reduce. ``cyclic``: the documents' schedule
    (phalanx.exchange.schedule) over point-to-point sends on the communication thread; each
    partition hops around the ring of ranks and is merged at every hop. ``native``: the
    backend's reduce_scatter.
  Phase 2 (finish): wait until every owned partition is fully reduced.
  Phase 3 (update): each owner steps the optimizer on its partitions only (optimizer state
    lives only there), then sends them back: ``cyclic`` broadcast schedule, or ``native``
    all_gather. This phase runs in the background: a layer's forward pre-hook waits only for
    the bucket(s) holding its own parameters, so the next forward overlaps the broadcast.

Parameters no rank used in a step get a zero gradient here (as in FSDP), not ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from phalanx.exchange import schedule
from phalanx.exchange.base import STRATEGIES, OptimizerFactory, Strategy
from phalanx.exchange.buckets import Bucket
from phalanx.exchange.comm import CommThread, wait
from phalanx.exchange.sharding import ShardedParameters, bounds
from phalanx.fields import option


@dataclass(kw_only=True)
class PartitionedConfig:
    """Options of the partitioned exchange."""

    schedule: Literal["cyclic", "native"] = option(
        "cyclic", "cyclic: the documents' ring schedule; native: reduce_scatter + all_gather"
    )


@STRATEGIES.register("partitioned")
class Partitioned(Strategy):
    """Owner-update exchange over partitions of every bucket (see the module docstring)."""

    Config = PartitionedConfig

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.config = PartitionedConfig(**options)
        self.sharded: ShardedParameters | None = None
        self.comm: CommThread | None = None
        self._pending_reduce: dict[int, Any] = {}
        self._pending_params: dict[int, Any] = {}
        self._reduced: dict[int, torch.Tensor] = {}
        self._hooks: list = []

    # -- layout -------------------------------------------------------------------------------
    def bucket_alignment(self, world_size: int) -> int:
        return world_size if self.config.schedule == "native" else 1

    def rebuilds_buckets(self) -> bool:
        return False  # parameters live in the strategy's buffers; keep the first layout

    def setup(self, ctx: Any, buckets: list[Bucket]) -> None:
        super().setup(ctx, buckets)
        p = ctx.world_size
        if self.config.schedule == "native":
            ranges = [bounds(b.flat.numel(), p) for b in buckets]
            owners = [list(range(p)) for _ in buckets]
        else:
            n = schedule.num_partitions(p)
            ranges = [bounds(b.flat.numel(), n) for b in buckets]
            owners = [[schedule.owner(m, p) for m in range(n)] for _ in buckets]
        self.ranges, self.owners = ranges, owners
        self.sharded = ShardedParameters(buckets, ranges, owners, ctx.rank)
        if self.comm is None:
            self.comm = CommThread(ctx.device)

    def build_optimizer(
        self, params: list[torch.nn.Parameter], factory: OptimizerFactory
    ) -> torch.optim.Optimizer:
        assert self.sharded is not None
        return factory(self.sharded.shard_params())

    # -- phase 1 and 2: reduce ----------------------------------------------------------------
    def launch(self, bucket: Bucket) -> None:
        assert self.comm is not None and self.ctx is not None
        self._wait_params(bucket.index)  # never reduce into a bucket still being broadcast
        if self.config.schedule == "native":
            p = self.ctx.world_size
            out = bucket.flat.new_empty(bucket.flat.numel() // p)
            work = dist.reduce_scatter_single(
                out, bucket.flat, group=self.comm.group, async_op=True
            )
            self._pending_reduce[bucket.index] = work
            self._reduced[bucket.index] = out
            self._count(out.nbytes * (p - 1), out.nbytes * (p - 1))
        else:
            job = self.comm.submit(lambda: self._cyclic_reduce(bucket))
            self._pending_reduce[bucket.index] = job
            self._reduced[bucket.index] = bucket.flat

    def finish(self) -> None:
        for b in sorted(self._pending_reduce):
            wait(self._pending_reduce.pop(b))

    def _cyclic_reduce(self, bucket: Bucket) -> None:
        """Runs on the communication thread: p-1 cycles, each rank sends or receives at most
        one partition per cycle and the receiver adds it to its own copy."""
        assert self.comm is not None and self.ctx is not None
        rank, ranges = self.ctx.rank, self.ranges[bucket.index]
        for cycle in schedule.reduce_cycles(self.ctx.world_size):
            for t in cycle:
                lo, hi = ranges[t.partition]
                if t.src == rank:
                    dist.send(bucket.flat[lo:hi], t.dst, group=self.comm.group)
                    self._count((hi - lo) * bucket.flat.element_size(), 0)
                elif t.dst == rank:
                    incoming = torch.empty_like(bucket.flat[lo:hi])
                    dist.recv(incoming, t.src, group=self.comm.group)
                    bucket.flat[lo:hi] += incoming
                    self._count(0, incoming.nbytes)

    # -- phase 3: update and send back --------------------------------------------------------
    def update(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.sharded is not None and self.comm is not None and self.ctx is not None
        offsets = {b: self._reduced_offset(b) for b in self._reduced}
        self.sharded.attach_grads(self._reduced, offsets)
        optimizer.step()
        for bucket in self.sharded.buckets:
            self._pending_params[bucket.index] = self._send_back(bucket)
        self._reduced = {}

    def _reduced_offset(self, b: int) -> int:
        """Where the reduced range of bucket b starts in its flat index space."""
        if self.config.schedule == "native":
            assert self.ctx is not None
            return self.ranges[b][self.ctx.rank][0]
        return 0  # cyclic reduces in place in the bucket

    def _send_back(self, bucket: Bucket) -> Any:
        assert self.sharded is not None and self.comm is not None and self.ctx is not None
        flat = self.sharded.flats[bucket.index]
        if self.config.schedule == "native":
            p, rank = self.ctx.world_size, self.ctx.rank
            lo, hi = self.ranges[bucket.index][rank]
            self._count(flat[lo:hi].nbytes * (p - 1), flat[lo:hi].nbytes * (p - 1))
            mine = flat[lo:hi].clone()
            return dist.all_gather_single(flat, mine, group=self.comm.group, async_op=True)
        self._count_planned(schedule.broadcast_cycles(self.ctx.world_size), bucket.index, flat)
        return self.comm.submit(lambda: self._cyclic_broadcast(bucket.index, flat))

    def _count_planned(self, cycles: list, b: int, flat: torch.Tensor) -> None:
        """Bytes this rank's part of a cyclic phase moves, tallied transfer by transfer (the
        job runs in the background, after this step's statistics are read)."""
        assert self.ctx is not None
        for cycle in cycles:
            for t in cycle:
                lo, hi = self.ranges[b][t.partition]
                size = (hi - lo) * flat.element_size()
                self._count(
                    size if t.src == self.ctx.rank else 0, size if t.dst == self.ctx.rank else 0
                )  # noqa: E501

    def _cyclic_broadcast(self, b: int, flat: torch.Tensor) -> None:
        assert self.comm is not None and self.ctx is not None
        rank, ranges = self.ctx.rank, self.ranges[b]
        with torch.no_grad():
            for cycle in schedule.broadcast_cycles(self.ctx.world_size):
                for t in cycle:
                    lo, hi = ranges[t.partition]
                    if t.src == rank:
                        dist.send(flat[lo:hi], t.dst, group=self.comm.group)
                    elif t.dst == rank:
                        dist.recv(flat[lo:hi], t.src, group=self.comm.group)

    # -- parameters arriving while the next forward runs --------------------------------------
    def register_module(self, module: torch.nn.Module) -> None:
        """Make each submodule wait, before its forward, for its own parameters only."""
        assert self.sharded is not None
        bucket_of = {id(p): b.index for b in self.sharded.buckets for p in b.params}
        for sub in module.modules():
            own = sub.parameters(recurse=False)
            indices = sorted({bucket_of[id(p)] for p in own if id(p) in bucket_of})
            if indices:
                self._hooks.append(sub.register_forward_pre_hook(self._waiter(indices)))

    def _waiter(self, indices: list[int]) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            for b in indices:
                self._wait_params(b)

        return hook

    def _wait_params(self, b: int) -> None:
        pending = self._pending_params.pop(b, None)
        if pending is not None:
            wait(pending)

    def sync(self) -> None:
        for b in list(self._pending_params):
            self._wait_params(b)

    # -- accounting and state -----------------------------------------------------------------
    def _count(self, sent: int, received: int) -> None:
        self.bytes_sent += sent
        self.bytes_received += received

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer, params: list) -> dict:
        assert self.sharded is not None and self.ctx is not None
        self.sync()
        return self.sharded.canonical_state(optimizer, params, self.ctx.group)

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, params: list, state: dict
    ) -> None:
        assert self.sharded is not None
        self.sharded.load_canonical_state(optimizer, params, state)

    def optimizer_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        assert self.sharded is not None
        return self.sharded.optimizer_bytes(optimizer)

    def close(self) -> None:
        self.sync()
        for h in self._hooks:
            h.remove()
        if self.comm is not None:
            self.comm.close()
