"""``allreduce``: each bucket is summed over ranks as soon as backward fills it (F14).

Uncompressed, it is the backend's asynchronous allreduce (a ring on Gloo and NCCL): each rank
sends about 2 (p-1)/p times the bucket's bytes, the volume ``bytes_sent`` reports since the
backend does not expose its own wire counters. With ``compress`` set, a backend allreduce
cannot sum messages that carry different per-rank scales, so the same ring runs over
point-to-point messages on the communication thread (``ring_allreduce``): every hop decodes
and adds in full precision, and the finished chunks travel on as the very bytes their owner
encoded.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phalanx.exchange.base import STRATEGIES, Strategy
from phalanx.exchange.buckets import Bucket
from phalanx.exchange.comm import CommThread, wait
from phalanx.exchange.compression import Codec
from phalanx.exchange.sharding import bounds


def _exchange(
    outgoing: torch.Tensor, incoming: torch.Tensor, rank: int, p: int, group: Any
) -> None:  # noqa: E501
    """Send to the next rank while receiving from the previous one (full duplex)."""
    works = [
        dist.isend(outgoing, (rank + 1) % p, group=group),
        dist.irecv(incoming, (rank - 1) % p, group=group),
    ]
    for work in works:
        work.wait()


def ring_allreduce(
    flat: torch.Tensor, rank: int, p: int, group: Any, codec: Codec
) -> tuple[int, int]:
    """Sum ``flat`` (1-D) over the ring in place; returns this rank's (sent, received) bytes.

    Phase 1 (reduce-scatter), step s = 0..p-2: send chunk (r-s-1) mod p, receive chunk
      (r-s-2) mod p and add it; afterwards chunk r is complete at rank r.
    Phase 2 (all-gather), step s = 0..p-2: pass on the message received in the previous step
      (first: chunk r, encoded once), receive chunk (r-s-1) mod p and store it.
    """
    chunks = bounds(flat.numel(), p)
    sent = received = 0
    # Phase 1: reduce-scatter.
    for s in range(p - 1):
        lo, hi = chunks[(rank - s - 1) % p]
        in_lo, in_hi = chunks[(rank - s - 2) % p]
        outgoing = codec.encode(flat[lo:hi])
        incoming = codec.scratch_message(flat[in_lo:in_hi])
        _exchange(outgoing, incoming, rank, p, group)
        codec.decode_add(incoming, flat[in_lo:in_hi])
        sent, received = sent + outgoing.nbytes, received + incoming.nbytes
    # Phase 2: all-gather, forwarding messages unchanged.
    lo, hi = chunks[rank]
    outgoing = codec.encode(flat[lo:hi])
    if codec.wire_dtype is not None:  # everyone holds what the owner's message decodes to
        codec.decode_into(outgoing, flat[lo:hi])
    for s in range(p - 1):
        in_lo, in_hi = chunks[(rank - s - 1) % p]
        incoming = codec.empty_message(flat[in_lo:in_hi])
        _exchange(outgoing, incoming, rank, p, group)
        codec.decode_into(incoming, flat[in_lo:in_hi])
        sent, received = sent + outgoing.nbytes, received + incoming.nbytes
        outgoing = incoming
    return sent, received


@STRATEGIES.register("allreduce")
class AllReduce(Strategy):
    """Average gradients per bucket, overlapped with backward (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._works: list[Any] = []
        self.comm: CommThread | None = None

    def setup(self, ctx: Any, buckets: list[Bucket]) -> None:
        super().setup(ctx, buckets)
        if self.codec.wire_dtype is not None and self.comm is None:
            self.comm = CommThread(ctx.device)

    def launch(self, bucket: Bucket) -> None:
        assert self.ctx is not None, "setup() first"
        if self.comm is not None:  # compressed: the point-to-point ring
            rank, p, group, codec = self.ctx.rank, self.ctx.world_size, self.comm.group, self.codec
            self._works.append(
                self.comm.submit(lambda: ring_allreduce(bucket.flat, rank, p, group, codec))
            )  # noqa: E501
            return
        # Gradients arrive pre-divided by p (the Engine scales the loss), so the sum is the mean.
        self._works.append(dist.all_reduce(bucket.flat, group=self.ctx.group, async_op=True))
        world = self.ctx.world_size
        volume = 2 * (world - 1) * bucket.nbytes // world
        self.bytes_sent += volume
        self.bytes_received += volume

    def finish(self) -> None:
        for work in self._works:
            wait(work)
            if self.comm is not None:
                sent, received = work.result()
                self.bytes_sent += sent
                self.bytes_received += received
        self._works = []

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()
