"""``ps``: a parameter server (F8, F9, F19 first half).

Each bucket is split into one partition per server. ``servers = k`` makes the last k ranks
dedicated servers (world = workers + servers); ``servers = 0`` makes every rank serve one
partition. A server keeps the master copy of its partitions and their optimizer state in CPU
memory.

Phases per bucket (one job on the communication thread, started as soon as backward fills the
bucket, so buckets are served layer by layer while backward continues, F8):
  Phase 1 (push): every worker sends each partition to its server, either directly (``star``)
    or summed pairwise up a binary tree rooted at the server (``tree``, F9).
  Phase 2 (update): the server steps the optimizer on that partition only, as soon as every
    worker's gradient for it has arrived.
  Phase 3 (pull): the server sends the updated partition back to every worker (``star``) or down
    the same tree. A layer's next forward waits only for its own bucket's pull. ``step`` returns
    once every server stepped (Phase 2), so a learning-rate scheduler stepped afterwards never
    changes the rate of an update still in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from phalanx.errors import ConfigError
from phalanx.exchange.base import STRATEGIES, OptimizerFactory, holds_nonfinite, stamp_done
from phalanx.exchange.buckets import Bucket
from phalanx.exchange.comm import global_rank
from phalanx.exchange.owners import OwnerUpdateStrategy
from phalanx.exchange.sharding import ShardedParameters, bounds
from phalanx.exchange.tree import tree_children, tree_parent
from phalanx.fields import option, require

logger = logging.getLogger("phalanx")


@dataclass(kw_only=True)
class ParamServerConfig:
    """Options of the parameter server."""

    servers: int = option(0, "dedicated server ranks (0: every rank serves a partition)")
    reduce: Literal["star", "tree"] = option("star", "push gradients directly or up a tree")

    def __post_init__(self) -> None:
        require(self.servers >= 0, "servers", f"must be >= 0, got {self.servers}")

    def check_world(self, world_size: int) -> None:
        if self.servers >= world_size:
            raise ConfigError(
                f"exchange.options.servers: {self.servers} servers leave no worker in a world of "
                f"{world_size}; use fewer than {world_size}"
            )


@STRATEGIES.register("ps")
class ParameterServer(OwnerUpdateStrategy):
    """Push, update at the server, pull, per bucket (see the module docstring)."""

    Config = ParamServerConfig
    updates_during_exchange = True  # servers update each bucket as it arrives (F8)

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.config = ParamServerConfig(**options)
        self.optimizer: torch.optim.Optimizer | None = None
        self._pushed: list[tuple[threading.Event, Any]] = []
        self._updated: list[tuple[threading.Event, Any]] = []
        self.num_nonfinite_partitions = 0  # partition updates the servers skipped (inf/NaN)

    # -- roles --------------------------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        assert self.ctx is not None
        return self.ctx.world_size - self.config.servers

    @property
    def is_trainer(self) -> bool:
        assert self.ctx is not None
        return self.ctx.rank < self.num_workers

    def data_parallel(self) -> tuple[int, int]:
        assert self.ctx is not None
        return min(self.ctx.rank, self.num_workers - 1), self.num_workers

    def _owners(self) -> list[int]:
        assert self.ctx is not None
        if self.config.servers == 0:
            return list(range(self.ctx.world_size))
        return list(range(self.num_workers, self.ctx.world_size))

    # -- layout -------------------------------------------------------------------------------
    def setup(self, ctx: Any, buckets: list[Bucket]) -> None:
        super().setup(ctx, buckets)
        self.config.check_world(ctx.world_size)
        owners = self._owners()
        self.ranges = [bounds(b.flat.numel(), len(owners)) for b in buckets]
        self.sharded = ShardedParameters(
            buckets, self.ranges, [owners] * len(buckets), ctx.rank, host_master=True
        )
        self._ensure_comm(ctx.device, ctx.group)

    def build_optimizer(
        self, params: list[torch.nn.Parameter], factory: OptimizerFactory
    ) -> torch.optim.Optimizer:
        assert self.sharded is not None
        self.optimizer = factory(self.sharded.shard_params())
        return self.optimizer

    def rebind_optimizer(
        self, optimizer: torch.optim.Optimizer, params: list, factory: Any, carried: Any
    ) -> None:
        super().rebind_optimizer(optimizer, params, factory, carried)
        self.optimizer = optimizer  # the servers step the user's optimizer object

    # -- the non-finite guard ------------------------------------------------------------------
    def inspect_gradients(self, want_norm: bool) -> tuple[bool, float | None]:
        """A bad loss was agreed before the exchange; gradients that turn inf/NaN under a finite
        loss are caught by each server on its own partitions (see ``_update``)."""
        assert not want_norm, "updates_during_exchange: the Engine refuses max_grad_norm"
        return False, None

    # -- the per-bucket job -------------------------------------------------------------------
    def launch(self, bucket: Bucket) -> None:
        assert self.comm is not None
        self._wait_params(bucket.index)
        pushed, updated = threading.Event(), threading.Event()
        self.count_bytes(*self._pull_bytes(bucket))  # the pull ends in the background: tally it now
        job = stamp_done(
            bucket, self.comm.submit(lambda: self._serve_bucket(bucket, pushed, updated))
        )
        self._pushed.append((pushed, job))
        self._updated.append((updated, job))
        self._pending_params[bucket.index] = job

    def _serve_bucket(
        self, bucket: Bucket, pushed: threading.Event, updated: threading.Event
    ) -> None:
        """Runs on the communication thread, partition by partition."""
        assert self.ctx is not None and self.sharded is not None
        owners = self._owners()
        grads = self._host(bucket.flat)
        summed: dict[int, torch.Tensor] = {}
        for m, owner in enumerate(owners):  # Phase 1: push
            lo, hi = self.ranges[bucket.index][m]
            summed[m] = self._push(grads[lo:hi], owner)
        pushed.set()  # the gradient buffer may be reused from here on
        for m, owner in enumerate(owners):  # Phase 2: update
            if owner == self.ctx.rank:
                self._update(bucket, m, summed[m])
        updated.set()  # the optimizer's hyperparameters may change from here on
        for m, owner in enumerate(owners):  # Phase 3: pull
            lo, hi = self.ranges[bucket.index][m]
            self._pull(self.sharded.flats[bucket.index], lo, hi, owner)

    def _host(self, flat: torch.Tensor) -> torch.Tensor:
        """Gradients as CPU tensors: servers keep everything in host memory."""
        return flat if flat.device.type == "cpu" else flat.to("cpu")

    def _participants(self, owner: int) -> list[int]:
        """The owner first (the tree's root), then the workers."""
        return [owner] + [w for w in range(self.num_workers) if w != owner]

    def _push(self, chunk: torch.Tensor, owner: int) -> torch.Tensor:
        """Sum of every worker's ``chunk`` at ``owner`` (returned there; others get their input)."""
        assert self.ctx is not None and self.comm is not None
        rank, group = self.ctx.rank, self.comm.group
        ranks = self._participants(owner)
        if rank not in ranks:
            return chunk
        if self.config.reduce == "star" and rank != owner:
            self.count_bytes(self.codec.send(chunk, owner, group), 0)
            return chunk
        total = chunk.clone() if rank < self.num_workers else torch.zeros_like(chunk)
        if self.config.reduce == "tree":
            return self._tree_up(total, ranks)
        for src in ranks[1:]:
            self.count_bytes(0, self.codec.recv_add(total, src, group))
        return total

    def _tree_up(self, total: torch.Tensor, ranks: list[int]) -> torch.Tensor:
        assert self.ctx is not None and self.comm is not None
        me, n, group = ranks.index(self.ctx.rank), len(ranks), self.comm.group
        for child in tree_children(me, n):
            self.count_bytes(0, self.codec.recv_add(total, ranks[child], group))
        parent = tree_parent(me)
        if parent is not None:
            self.count_bytes(self.codec.send(total, ranks[parent], group), 0)
        return total

    def _update(self, bucket: Bucket, m: int, summed: torch.Tensor) -> None:
        """Step the optimizer on partition m of this bucket only (others have no gradient)."""
        assert self.sharded is not None and self.optimizer is not None
        lo, _ = self.ranges[bucket.index][m]
        if holds_nonfinite([summed]):
            # Earlier buckets may already be updated: only this partition can still be saved.
            logger.warning(
                "phalanx: ps server %d: inf/NaN gradients in bucket %d, partition %d: its update "
                "is skipped (a finite loss with inf/NaN gradients; other partitions may have "
                "been updated)", self.ctx.rank if self.ctx else -1, bucket.index, m,
            )  # fmt: skip
            self.num_nonfinite_partitions += 1
            return
        started = time.perf_counter()
        mine = [s for s in self.sharded.shards if s.bucket == bucket.index and s.start == lo]
        for shard in self.sharded.shards:
            shard.param.grad = None
        for shard in mine:  # the reduced range may end with usage flags and padding: cut them
            shard.param.grad = summed[: shard.end - shard.start].to(shard.param.device)
        self.optimizer.step()
        for shard in mine:  # a host master (CUDA runs): the replica gets the new values too
            self.sharded.write_back(shard)
        self.update_spans.append((bucket.index, started, time.perf_counter()))  # for traces

    def _pull(self, flat: torch.Tensor, lo: int, hi: int, owner: int) -> None:
        """The updated partition [lo, hi) travels from ``owner`` to every worker."""
        assert self.ctx is not None and self.comm is not None
        rank, group = self.ctx.rank, self.comm.group
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
        """Who this rank receives the updated partition from, and whom it forwards it to
        (star: the owner sends to every worker; tree: down the tree rooted at the owner)."""
        assert self.ctx is not None
        me = ranks.index(self.ctx.rank)
        if self.config.reduce == "tree":
            parent = tree_parent(me)
            children = reversed(tree_children(me, len(ranks)))
            return (None if parent is None else ranks[parent]), [ranks[c] for c in children]
        return (None, ranks[1:]) if me == 0 else (ranks[0], [])

    def _pull_bytes(self, bucket: Bucket) -> tuple[int, int]:
        """(sent, received) bytes of this rank's pull of ``bucket``, message by message."""
        assert self.ctx is not None
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

    # -- the Engine's phases ------------------------------------------------------------------
    def finish(self) -> None:
        """Wait until every bucket was pushed (the gradient buffers are free again)."""
        _wait_events(self._pushed)
        self._pushed = []

    def update(self, optimizer: torch.optim.Optimizer) -> None:
        """Wait until the servers stepped every bucket (so the step used this step's learning
        rate, whatever a scheduler does next); pulls finish in the background and each
        layer's forward waits for its own."""
        del optimizer
        _wait_events(self._updated)
        self._updated = []


def _wait_events(pending: list[tuple[threading.Event, Any]]) -> None:
    """Wait for each event; a job that ended without setting its event re-raises its error."""
    for event, job in pending:
        while not event.wait(0.05):
            if job.done():
                job.result()
