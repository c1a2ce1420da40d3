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

import math
from typing import Any

import torch
import torch.distributed as dist

from phalanx.exchange.base import STRATEGIES, Strategy, StrategyParts, stamp_done
from phalanx.exchange.buckets import Bucket
from phalanx.exchange.comm import global_rank, wait
from phalanx.exchange.compression import Codec
from phalanx.runtime.context import Context


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


@STRATEGIES.register("tree")
class Tree(Strategy):
    """Binary-tree reduce + broadcast per bucket over point-to-point messages."""

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
