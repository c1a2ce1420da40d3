"""``allreduce``: each bucket is averaged with the backend's asynchronous allreduce (F14).

NCCL and Gloo implement it as a ring (or a tree for small messages on NCCL), so each rank sends
about 2 (p-1)/p times the bucket's bytes; that volume is what ``bytes_sent`` reports, as the
backend does not expose its own wire counters.
"""

from __future__ import annotations

import torch.distributed as dist

from phalanx.exchange.base import STRATEGIES, Strategy
from phalanx.exchange.buckets import Bucket


@STRATEGIES.register("allreduce")
class AllReduce(Strategy):
    """Average gradients with ``dist.all_reduce`` per bucket, overlapped with backward."""

    def __init__(self) -> None:
        super().__init__()
        self._works: list[dist.Work] = []

    def launch(self, bucket: Bucket) -> None:
        assert self.ctx is not None, "setup() first"
        world = self.ctx.world_size
        # Gradients arrive pre-divided by p (the Engine scales the loss), so the sum is the mean.
        self._works.append(dist.all_reduce(bucket.flat, group=self.ctx.group, async_op=True))
        volume = 2 * (world - 1) * bucket.nbytes // world
        self.bytes_sent += volume
        self.bytes_received += volume

    def finish(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []
