"""``ps``: a parameter server (F8, F9, F19 first half); servers keep their partitions' master
copy and optimizer state in CPU memory (options and costs: docs/exchange.md).

Per bucket, one job on the communication thread, launched in the Engine's Phase 2 (Phase 4
waits for every push, Phase 5 for every update; pulls end in the background):
  Push: each partition to its server, directly (``star``) or summed up a tree (``tree``, F9).
  Update: the server steps the optimizer on that partition as soon as it is summed.
  Pull: the updated partition back to every worker; a layer's forward waits for its own.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from phalanx.errors import ConfigError
from phalanx.exchange.base import STRATEGIES, StrategyParts, holds_nonfinite, stamp_done
from phalanx.exchange.buckets import Bucket
from phalanx.exchange.comm import global_rank, wait_all
from phalanx.exchange.messages import (
    FORWARD_PASS,
    GRAD,
    PARAM,
    Builder,
    MessageSchedule,
    Phase,
    RoundTable,
)
from phalanx.exchange.owners import OwnerUpdateStrategy
from phalanx.exchange.sharding import Optimizer, Shard, ShardedParameters, bounds, used_flags
from phalanx.exchange.tree import tree_children, tree_down, tree_parent, tree_up
from phalanx.fields import option, require
from phalanx.runtime.context import Context

if TYPE_CHECKING:
    from phalanx.exchange.messages import WireCodec

logger = logging.getLogger("phalanx")


@dataclass(kw_only=True)
class ParamServerConfig:
    """Options of the parameter server."""

    servers: int = option(0, "dedicated server ranks (0: every rank serves a partition)")
    reduce: Literal["star", "tree"] = option("star", "push gradients directly or up a tree")

    def __post_init__(self) -> None:
        require(self.servers >= 0, "servers", f"must be >= 0, got {self.servers}")


def star_turn(server: int, worker: int, num_servers: int) -> int:
    """Worker w meets server (w + t) mod k in turn t: distinct ports per turn."""
    return (server - worker) % num_servers


def roles(config: ParamServerConfig, world_size: int) -> tuple[list[int], list[int]]:
    """(servers, workers): the last ``servers`` ranks serve (0: every rank does both)."""
    workers = list(range(world_size - config.servers))
    return (workers if config.servers == 0 else list(range(len(workers), world_size))), workers


@functools.lru_cache(maxsize=64)
def ps_rounds(
    world: int, owners: tuple[int, ...], workers: tuple[int, ...], reduce: str, pull: bool
) -> RoundTable:
    """The push (or pull) of one bucket: star in ``star_turn`` order, or tree per partition."""
    b = Builder()
    share = 1.0 / len(owners)
    if reduce == "tree":
        for owner in owners:
            ranks = [owner] + [w for w in workers if w != owner]
            if pull:
                tree_down(ranks, share, PARAM, b)
            else:
                tree_up(ranks, share, b)
    else:
        pairs = sorted(
            ((owner, w) for owner in owners for w in workers if w != owner),
            key=lambda pair: (star_turn(owners.index(pair[0]), pair[1], len(owners)), pair[1]),
        )
        kind = PARAM if pull else GRAD
        b.round(((o, w, share, kind) if pull else (w, o, share, kind)) for o, w in pairs)
    return b.table("ps", world, owners, workers, reduce, pull)


class ParameterServerSchedule(MessageSchedule):
    """Per bucket: push each partition to its server, the server updates it, pull it back."""

    config: ParamServerConfig

    def bucket_phases(self, world: int, codec: WireCodec, nbytes: float) -> list[Phase]:
        owners, workers = (tuple(r) for r in roles(self.config, world))
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


@STRATEGIES.register("ps")
class ParameterServer(OwnerUpdateStrategy):
    """Push, update at the server, pull, per bucket."""

    Config = ParamServerConfig
    Messages = ParameterServerSchedule
    updates_during_exchange = True  # servers update each bucket as it arrives (F8)

    def __init__(self, ctx: Context, buckets: list[Bucket], parts: StrategyParts) -> None:
        super().__init__(ctx, buckets, parts)
        self.config = parts.config or ParamServerConfig()
        self.check_world(self.config, ctx.world_size)
        owners = self._owners()
        self.ranges = [bounds(b.flat.numel(), len(owners)) for b in buckets]
        self.sharded = ShardedParameters(
            buckets,
            self.ranges,
            [owners] * len(buckets),
            ctx.rank,
            host_master=True,
            group_of=self.group_of,
        )
        self._shards_of: dict[tuple[int, int], list[Shard]] = {}  # (bucket, partition)
        for shard in self.sharded.shards:
            m = _partition_of(self.ranges[shard.bucket], shard.start)
            self._shards_of.setdefault((shard.bucket, m), []).append(shard)
        self.optimizer: Optimizer | None = None  # the user's, pointed at the shards
        self._pushed: list[tuple[threading.Event, Any]] = []
        self._updated: list[tuple[threading.Event, Any]] = []

    @classmethod
    def check_world(cls, config: ParamServerConfig, world_size: int) -> None:
        if config.servers >= world_size:
            raise ConfigError(
                f"exchange.options.servers: {config.servers} servers leave no worker in a world "
                f"of {world_size}; use fewer than {world_size}"
            )

    @classmethod
    def num_trainers(cls, config: ParamServerConfig, world_size: int) -> int:
        return len(roles(config, world_size)[1])

    @property
    def num_workers(self) -> int:
        return self.num_trainers(self.config, self.ctx.world_size)

    @property
    def is_trainer(self) -> bool:
        return self.ctx.rank < self.num_workers

    def data_parallel(self) -> tuple[int, int]:
        return min(self.ctx.rank, self.num_workers - 1), self.num_workers

    def _owners(self) -> list[int]:
        return roles(self.config, self.ctx.world_size)[0]

    def adopt_optimizer(self, optimizer: Optimizer, params: list) -> Optimizer:
        self.optimizer = super().adopt_optimizer(optimizer, params)  # the servers step it
        return self.optimizer

    def rebind_optimizer(self, optimizer: Optimizer, params: list, carried: Any) -> None:
        super().rebind_optimizer(optimizer, params, carried)
        self.optimizer = optimizer

    def inspect_gradients(
        self, want_norm: bool, riders: torch.Tensor | None = None
    ) -> tuple[bool, float | None]:
        """A bad loss was agreed before the exchange; servers check their partitions."""
        assert not want_norm, "updates_during_exchange: the Engine refuses max_grad_norm"
        assert riders is None, "no all-reduce here to ride in"
        return False, None

    def launch(self, bucket: Bucket) -> None:
        self._wait_params(bucket.index)
        pushed, updated = threading.Event(), threading.Event()
        self.count_bytes(*self._pull_bytes(bucket))  # the pull ends in the background: tally it now
        job = stamp_done(
            bucket, self.comm_thread().submit(lambda: self._serve_bucket(bucket, pushed, updated))
        )
        self._pushed.append((pushed, job))
        self._updated.append((updated, job))
        self._pending_params[bucket.index] = job

    def _serve_bucket(
        self, bucket: Bucket, pushed: threading.Event, updated: threading.Event
    ) -> None:
        owners = self._owners()
        grads = self._host(bucket.flat)
        used = self._agree_usage(bucket)
        if self.config.reduce == "star":  # Push
            summed = self._push_star(bucket.index, grads)
        else:
            summed = {m: self._push_tree(bucket.index, grads, m) for m in range(len(owners))}
        # The gradient buffer may be reused from here on: the Engine writes to it next in the
        # next step's backward, after update() waited for ``updated`` (each server's sum lies
        # in its own partitions until their update).
        pushed.set()
        for m, owner in enumerate(owners):  # Update
            if owner == self.ctx.rank:
                self._update(bucket, m, summed[m], used)
        updated.set()  # the optimizer's hyperparameters may change from here on
        started = time.perf_counter()
        flat = self.sharded.flats[bucket.index]
        if self.config.reduce == "star":  # Pull
            self._pull_star(bucket.index, flat)
        else:
            for m, owner in enumerate(owners):
                lo, hi = self.ranges[bucket.index][m]
                self._pull_tree(flat, lo, hi, owner)
        self._record_span("exchange", f"b{bucket.index} pull", bucket, started)

    def _record_span(self, lane: str, name: str, bucket: Bucket, started: float) -> None:
        """A span of this thread's work, from ``started`` to now, for the Engine's traces."""
        span = (lane, name, bucket.index, bucket.nbytes, started, time.perf_counter())
        self.thread_spans.append(span)

    def _agree_usage(self, bucket: Bucket) -> list[bool]:
        """Whether any rank used each parameter: one all-reduce of the flags (cheaper here)."""
        flags = self._host(bucket.flags).to(torch.float64, copy=True)
        dist.all_reduce(flags, group=self.comm_thread().group)
        return used_flags(flags)

    def _host(self, flat: torch.Tensor) -> torch.Tensor:
        """As a CPU tensor: servers keep everything in host memory."""
        return flat if flat.device.type == "cpu" else flat.to("cpu")

    def _participants(self, owner: int) -> list[int]:
        """The owner first (the tree's root), then the workers."""
        return [owner] + [w for w in range(self.num_workers) if w != owner]

    def _push_star(self, b: int, grads: torch.Tensor) -> dict[int, torch.Tensor]:
        """Push ``grads``' partitions to their servers at once; returns {partition: sum} here."""
        rank, group, codec = self.ctx.rank, self.comm_thread().group, self.codec
        owners, ranges = self._owners(), self.ranges[b]
        trainer = rank < self.num_workers
        turn = functools.partial(star_turn, num_servers=len(owners))  # distinct ports per turn
        outgoing = [m for m, owner in enumerate(owners) if trainer and owner != rank]
        outgoing.sort(key=lambda m: turn(m, rank))
        sizes = [ranges[m][1] - ranges[m][0] for m in outgoing]
        messages: list[torch.Tensor | None] = [None] * len(outgoing)  # no codec: the slices
        if codec.wire_dtype is not None:  # a codec that copies encodes into the arena
            messages = list(codec.message_views("push", sizes, grads))
        works, sent = [], 0
        for m, message in zip(outgoing, messages):
            lo, hi = ranges[m]
            message = codec.encode(grads[lo:hi], out=message)
            works.append(dist.isend(message, global_rank(group, owners[m]), group=group))
            sent += message.nbytes
        incoming: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for m in (m for m, owner in enumerate(owners) if owner == rank):
            lo, hi = ranges[m]
            sources = sorted(
                (w for w in range(self.num_workers) if w != rank), key=lambda w: turn(m, w)
            )
            views = codec.message_views(f"push-in {m}", [hi - lo] * len(sources), grads)
            incoming[m] = list(zip(sources, views))
            for src, view in incoming[m]:
                works.append(dist.irecv(view, global_rank(group, src), group=group))
        wait_all(works)
        summed, received = {}, 0
        for m, messages_in in incoming.items():
            lo, hi = ranges[m]
            total = _own_sum(grads[lo:hi], trainer)
            for _, view in sorted(messages_in, key=lambda pair: pair[0]):  # sums in rank order
                codec.decode_add(view, total)
                received += view.nbytes
            summed[m] = total
        self.count_bytes(sent, received)
        return summed

    def _push_tree(self, b: int, grads: torch.Tensor, m: int) -> torch.Tensor:
        """Partition m of bucket ``b``'s gradients summed up a tree rooted at its server."""
        owner = self._owners()[m]
        lo, hi = self.ranges[b][m]
        chunk = grads[lo:hi]
        ranks = self._participants(owner)
        if self.ctx.rank not in ranks:
            return chunk
        total = _own_sum(chunk, self.ctx.rank < self.num_workers)
        me, n, group = ranks.index(self.ctx.rank), len(ranks), self.comm_thread().group
        for child in tree_children(me, n):
            self.count_bytes(0, self.codec.recv_add(total, ranks[child], group))
        parent = tree_parent(me)
        if parent is not None:
            self.count_bytes(self.codec.send(total, ranks[parent], group), 0)
        return total

    def _update(self, bucket: Bucket, m: int, summed: torch.Tensor, used: list[bool]) -> None:
        """Step the optimizer on partition m of this bucket, its parameters some rank used."""
        assert self.optimizer is not None, "adopt_optimizer first"
        lo, hi = self.ranges[bucket.index][m]
        if holds_nonfinite([summed]):
            # Earlier buckets may already be updated: only this partition can still be saved.
            logger.warning(
                "phalanx: ps server %d: inf/NaN gradients in bucket %d, partition %d: its update "
                "is skipped (a finite loss with inf/NaN gradients; other partitions may have "
                "been updated)", self.ctx.rank if self.ctx else -1, bucket.index, m,
            )  # fmt: skip
            return
        started = time.perf_counter()
        mine = [s for s in self._shards_of.get((bucket.index, m), []) if used[s.slot]]
        for shard in mine:  # the reduced range may end with usage flags and padding: cut them
            grad = summed[shard.start - lo : shard.end - lo]
            shard.param.grad = grad.to(shard.param.device)
        self.optimizer.step()  # every other shard's grad is None: not stepped
        for shard in mine:  # a host master (CUDA runs): the replica gets the new values too
            shard.param.grad = None  # the summed gradient is not kept past its update
            self.sharded.write_back(shard)
        self._record_span("optimizer", f"update b{bucket.index}", bucket, started)

    def _pull_star(self, b: int, flat: torch.Tensor) -> None:
        """Every server's updated partitions of ``flat`` (1-D) to every worker, all at once."""
        rank, group = self.ctx.rank, self.comm_thread().group
        owners = self._owners()
        pairs = [(m, w) for m, o in enumerate(owners) for w in range(self.num_workers) if w != o]
        pairs.sort(key=lambda pair: (star_turn(pair[0], pair[1], len(owners)), pair[1]))
        works, arrivals, mine = [], [], {}
        for m, worker in pairs:  # the same turns as the push: distinct ports per turn
            owner, (lo, hi) = owners[m], self.ranges[b][m]
            if rank == owner:
                if m not in mine:  # one host copy of the partition for every worker (CUDA)
                    mine[m] = self._host(flat[lo:hi])
                works.append(dist.isend(mine[m], global_rank(group, worker), group=group))
            elif rank == worker:
                piece = self._host(flat[lo:hi])
                works.append(dist.irecv(piece, global_rank(group, owner), group=group))
                arrivals.append((piece, lo, hi))
        wait_all(works)
        for piece, lo, hi in arrivals:
            if piece.data_ptr() != flat[lo:hi].data_ptr():  # a device bucket: copy it in
                flat[lo:hi].copy_(piece)

    def _pull_tree(self, flat: torch.Tensor, lo: int, hi: int, owner: int) -> None:
        """The updated partition [lo, hi) from ``owner`` down the tree to every worker."""
        rank, group = self.ctx.rank, self.comm_thread().group
        ranks = self._participants(owner)
        if rank not in ranks:
            return
        piece = self._host(flat[lo:hi])
        parent, children = self._pull_links(ranks)
        if parent is not None:
            dist.recv(piece, global_rank(group, parent), group=group)
        for child in children:
            dist.send(piece, global_rank(group, child), group=group)
        if piece.data_ptr() != flat[lo:hi].data_ptr():
            flat[lo:hi].copy_(piece)

    def _pull_links(self, ranks: list[int]) -> tuple[int | None, list[int]]:
        """(the rank this one receives the partition from, the ranks it forwards it to)."""
        me = ranks.index(self.ctx.rank)
        if self.config.reduce == "tree":
            parent = tree_parent(me)
            children = reversed(tree_children(me, len(ranks)))
            return (None if parent is None else ranks[parent]), [ranks[c] for c in children]
        return (None, ranks[1:]) if me == 0 else (ranks[0], [])

    def _pull_bytes(self, bucket: Bucket) -> tuple[int, int]:
        """(sent, received) bytes of this rank's pull of ``bucket``, message by message."""
        sent = received = 0
        itemsize = bucket.flat.element_size()
        for m, owner in enumerate(self._owners()):
            ranks = self._participants(owner)
            if self.ctx.rank not in ranks:
                continue
            lo, hi = self.ranges[bucket.index][m]
            parent, children = self._pull_links(ranks)
            received += (hi - lo) * itemsize if parent is not None else 0
            sent += (hi - lo) * itemsize * len(children)
        return sent, received

    def finish(self) -> None:
        """Wait until every bucket was pushed (the gradient buffers are free again)."""
        _wait_events(self._pushed)
        self._pushed = []

    def update(self, optimizer: Optimizer) -> None:
        """Wait until the servers stepped every bucket (pulls finish in the background)."""
        del optimizer
        _wait_events(self._updated)
        self._updated = []


def _own_sum(chunk: torch.Tensor, trainer: bool) -> torch.Tensor:
    """Where a partition's sum accumulates: this rank's gradients in place, or zeros (server)."""
    return chunk if trainer else chunk.zero_()


def _partition_of(ranges: list[tuple[int, int]], start: int) -> int:
    """The index of the range of ``ranges`` that holds flat index ``start``."""
    return next(m for m, (lo, hi) in enumerate(ranges) if lo <= start < hi)


def _wait_events(pending: list[tuple[threading.Event, Any]]) -> None:
    """Wait for each event; a job that ended without setting its event re-raises its error."""
    for event, job in pending:
        while not event.wait(0.05):
            if job.done():
                job.result()
