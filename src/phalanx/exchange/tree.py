"""``tree``: binary-tree reduction to rank 0 and back down the same tree (F9), any world size.

Phases per bucket (a job on the communication thread, so it runs while backward continues):
  Phase 1 (up): in round s a rank whose lowest set bit is s sends its partial sum to rank - 2^s.
  Phase 2 (down): the root encodes the sum once; every rank forwards that message unchanged.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from phalanx.exchange.base import STRATEGIES, Strategy, StrategyParts, stamp_done
from phalanx.exchange.buckets import Bucket
from phalanx.exchange.comm import global_rank, wait
from phalanx.exchange.compression import Codec
from phalanx.exchange.messages import FORWARD, GRAD, Builder, MessageSchedule, Phase, RoundTable
from phalanx.runtime.context import Context

if TYPE_CHECKING:
    from phalanx.exchange.messages import WireCodec


def tree_children(rank: int, world_size: int) -> list[int]:
    """Ranks that send their partial sums to ``rank``, in round order (nearest first)."""
    children = []
    for s in range(max(1, math.ceil(math.log2(world_size))) if world_size > 1 else 0):
        step = 1 << s
        if rank & step:
            break
        if rank + step < world_size:
            children.append(rank + step)
    return children


def tree_parent(rank: int) -> int | None:
    """The rank ``rank`` sends its partial sum to (None for the root): clear its lowest bit."""
    return None if rank == 0 else rank & (rank - 1)


def tree_allreduce(
    flat: torch.Tensor, rank: int, world_size: int, group: Any, codec: Codec | None = None
) -> tuple[int, int]:
    """Sum ``flat`` (1-D, any dtype/device) in place; returns this rank's (sent, received)."""
    codec = codec or Codec()
    sent = received = 0
    children, parent = tree_children(rank, world_size), tree_parent(rank)
    # Phase 1: up the tree.
    for child in children:
        received += codec.recv_add(flat, child, group)
    if parent is not None:
        sent += codec.send(flat, parent, group)
    # Phase 2: down the tree, the root's encoding passed on as it is: all ranks decode the
    # same bytes; a rank decodes after forwarding, off its children's path.
    if parent is None:
        message = codec.encode(flat, out=codec.send_buffer(flat))
    else:
        message = codec.recv_message(flat, parent, group)
        received += message.nbytes
    for child in reversed(children):
        dist.send(message, global_rank(group, child), group=group)
        sent += message.nbytes
    codec.decode_into(message, flat)
    return sent, received


def tree_up(ranks: list[int], share: float, b: Builder) -> None:
    """Rounds of ``tree_allreduce``'s Phase 1 over positions in ``ranks``, to ranks[0]."""
    depth = math.ceil(math.log2(len(ranks))) if len(ranks) > 1 else 0
    for s in range(depth):
        b.round(
            (ranks[i], ranks[tree_parent(i) or 0], share, GRAD)
            for i in range(1, len(ranks))
            if (i & -i) == 1 << s
        )


def tree_down(
    ranks: list[int], share: float, kind: int, b: Builder, passed_on: int | None = None
) -> None:
    """Back down the tree, farthest child first; ``passed_on``: later rounds' kind."""
    n = len(ranks)
    depth = math.ceil(math.log2(n)) if n > 1 else 0
    for t in range(depth):
        step = 1 << (depth - 1 - t)
        later = kind if passed_on is None else passed_on
        b.round(
            ((ranks[i], ranks[i + step], share, kind if t == 0 else later)
             for i in range(0, n - step, 2 * step)),  # i + step: i's child
            summed=False,  # the result: stored, not added
        )  # fmt: skip


@functools.lru_cache(maxsize=64)
def tree_rounds(world: int) -> RoundTable:
    """Up the tree, then down: the root's message GRAD, every later one FORWARD."""
    b = Builder()
    tree_up(list(range(world)), 1.0, b)
    tree_down(list(range(world)), 1.0, GRAD, b, passed_on=FORWARD)
    return b.table("tree", world)


class TreeSchedule(MessageSchedule):
    """Binary-tree reduce to rank 0 and broadcast back down, the whole bucket per message."""

    def bucket_phases(self, world: int, codec: WireCodec, nbytes: float) -> list[Phase]:
        return [Phase("tree", tree_rounds(world))] if world > 1 else []


@STRATEGIES.register("tree")
class Tree(Strategy):
    """Binary-tree reduce + broadcast per bucket over point-to-point messages."""

    Messages = TreeSchedule

    def __init__(self, ctx: Context, buckets: list[Bucket], parts: StrategyParts) -> None:
        super().__init__(ctx, buckets, parts)
        self.comm_thread()
        self._jobs: list[Any] = []

    @classmethod
    def sums_whole_buckets(cls, config: Any, codec: Codec) -> bool:
        del config
        return codec.wire_dtype is None  # compressed messages round what they carry

    def launch(self, bucket: Bucket) -> None:
        comm = self.comm_thread()
        rank, world, group, codec = self.ctx.rank, self.ctx.world_size, comm.group, self.codec
        job = comm.submit(lambda: tree_allreduce(bucket.flat, rank, world, group, codec))
        stamp_done(bucket, job)
        self._jobs.append((bucket, job))

    def finish(self) -> None:
        for bucket, job in self._jobs:
            wait(job)
            self.count_bytes(*job.result())
            self.bucket_exchanged(bucket)
        self._jobs = []
