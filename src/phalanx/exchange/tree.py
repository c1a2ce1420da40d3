"""``tree``: binary-tree reduction to rank 0 and back down the same tree (F9).

Phases per bucket (a job on the communication thread, so it runs while backward continues):
  Phase 1 (up): in round s (s = 0 .. ceil(log2 p) - 1), a rank whose lowest set bit is s sends
    its partial sum to rank - 2^s and is done; a rank with bits 0..s clear receives from
    rank + 2^s (if that rank exists) and adds. After ceil(log2 p) rounds rank 0 holds the sum.
  Phase 2 (down): the root encodes the sum once; each other rank receives that message from
    the rank it sent to, forwards it unchanged to the ranks it received from (farthest first),
    then decodes it.
Any world size works: a missing partner is skipped. Each rank sends and receives the bucket at
most 1 + (number of its children) times; rank 0 is the busiest (ceil(log2 p) sends down).
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
    """Sum ``flat`` (1-D, any dtype/device) over the group in place; returns (sent, received)
    bytes of this rank. ``codec`` may compress the messages; sums stay in ``flat``'s dtype."""
    codec = codec or Codec()
    sent = received = 0
    children, parent = tree_children(rank, world_size), tree_parent(rank)
    # Phase 1: up the tree.
    for child in children:
        received += codec.recv_add(flat, child, group)
    if parent is not None:
        sent += codec.send(flat, parent, group)
    # Phase 2: down the tree. The root encodes the sum once and every other rank passes the
    # message it received on as it is: all ranks decode the same bytes (identical results),
    # and no rank re-encodes what it decoded. A rank decodes after forwarding, so its own
    # decode is not on its children's path.
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


# -- the messages, for the planner -----------------------------------------------------------------
def tree_up(ranks: list[int], share: float, b: Builder) -> None:
    """Rounds of the reduction to ranks[0] over positions 0..n-1 (``tree_allreduce``'s Phase
    1): in round s, position i whose lowest set bit is s sends its partial sum to its parent."""
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
    """Back down the same tree: each position forwards what it received to its children,
    farthest first (a binomial broadcast from ranks[0], ceil(log2 n) rounds). ``kind``: the
    first round's messages; ``passed_on`` (default ``kind``): the later rounds', whose message
    the sender already holds in wire form (the root's encoding, sent again or forwarded)."""
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
    """Reduce to rank 0 up a binary tree, then back down (F9). The root encodes the sum once
    (GRAD: encoded there, decoded at the child); every later message is that encoding passed
    on (FORWARD: decoded only), as ``tree_allreduce`` sends it."""
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
