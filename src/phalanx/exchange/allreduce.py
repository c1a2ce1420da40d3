"""``allreduce``: each bucket summed over ranks as soon as backward fills it (F14)."""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from phalanx.exchange.base import STRATEGIES, Strategy, StrategyParts, stamp_done
from phalanx.exchange.buckets import Bucket
from phalanx.exchange.comm import wait
from phalanx.exchange.compression import Codec
from phalanx.exchange.messages import GRAD, Builder, MessageSchedule, Phase, RoundTable, ring_rounds
from phalanx.exchange.ring import GATHER_MAX_BYTES, GatherExchange, p2p_allreduce, prefers_gather
from phalanx.runtime.context import Context, hold_until_shutdown

if TYPE_CHECKING:
    from phalanx.exchange.messages import WireCodec


@functools.lru_cache(maxsize=64)
def gather_rounds(world: int) -> RoundTable:
    """Every rank's whole message to every other in one round (``ring.GatherExchange``)."""
    b = Builder()
    b.round((s, d, 1.0, GRAD) for s in range(world) for d in range(world) if s != d)
    return b.table("gather", world)


class AllReduceSchedule(MessageSchedule):
    """The backend's ring allreduce; compressed: phalanx's ring or gather (exchange/ring.py)."""

    def bucket_phases(self, world: int, codec: WireCodec, nbytes: float) -> list[Phase]:
        if world < 2:
            return []
        if codec.compresses and world == 2 and codec.wire_bytes(nbytes) <= GATHER_MAX_BYTES:
            return [Phase("gather", gather_rounds(world))]
        # uncompressed: the backend's allreduce; compressed: phalanx's ring
        return [Phase("allreduce", ring_rounds(world, backend=not codec.compresses))]

    def on_thread(self, codec: WireCodec, last: bool) -> bool:
        # uncompressed: the backend's own collectives; compressed: the thread, except the
        # last bucket, which the compute thread exchanges itself (``AllReduce.launch``)
        return codec.compresses and not last


@STRATEGIES.register("allreduce")
class AllReduce(Strategy):
    """Average gradients per bucket, overlapped with backward."""

    Messages = AllReduceSchedule

    def __init__(self, ctx: Context, buckets: list[Bucket], parts: StrategyParts) -> None:
        super().__init__(ctx, buckets, parts)
        self._works: list[Any] = []
        # The last step's backend works: the Python side keeps the last reference to each
        # until the next step (or, at close, until the groups are gone: hold_until_shutdown).
        self._finished_works: list[Any] = []
        self._last: Bucket | None = None
        self._gather: GatherExchange | None = None
        if self.codec.wire_dtype is not None:  # compressed: point-to-point on the thread
            self.comm_thread()

    @classmethod
    def sums_whole_buckets(cls, config: Any, codec: Codec) -> bool:
        del config
        return codec.wire_dtype is None  # compressed messages round what they carry

    def launch(self, bucket: Bucket) -> None:
        if self.comm is not None:  # compressed: point-to-point messages
            if bucket.index == len(self.buckets) - 1:
                # Buckets launch in index order, so this one comes as backward ends: handing
                # it to the communication thread would only add two thread wake-ups. A gather
                # starts here (its messages travel while backward winds down), a ring in finish.
                self._last = bucket
                flat, ctx = bucket.flat, self.ctx
                if prefers_gather(flat, ctx.world_size, self.codec):
                    self._gather = GatherExchange(
                        flat, ctx.rank, ctx.world_size, ctx.group, self.codec
                    ).start()
                return
            rank, p, group, codec = self.ctx.rank, self.ctx.world_size, self.comm.group, self.codec
            job = self.comm.submit(lambda: p2p_allreduce(bucket.flat, rank, p, group, codec))
            self._works.append((bucket, stamp_done(bucket, job)))
            return
        if self.ctx.world_size == 1:  # the sum is the bucket: skip the backend's hand-off
            bucket.done_time = time.perf_counter()
            self._works.append((bucket, None))
            return
        # Gradients arrive pre-divided by p (the Engine scales the loss), so the sum is the mean.
        work = dist.all_reduce(bucket.flat, group=self.ctx.group, async_op=True)
        self._works.append((bucket, stamp_done(bucket, work)))
        world = self.ctx.world_size
        volume = 2 * (world - 1) * bucket.nbytes // world
        self.count_bytes(volume, volume)

    def finish(self) -> None:
        if self._last is not None:  # on the main group: its messages never meet the thread's
            if self._gather is not None:
                self.count_bytes(*self._gather.finish())
            else:
                flat, ctx = self._last.flat, self.ctx
                self.count_bytes(
                    *p2p_allreduce(flat, ctx.rank, ctx.world_size, ctx.group, self.codec)
                )
            self.bucket_exchanged(self._last)
            self._last = self._gather = None
        for bucket, work in self._works:
            if work is not None:
                wait(work)
            if self.comm is not None:
                self.count_bytes(*work.result())
            self.bucket_exchanged(bucket)
        self._finished_works = [w for _, w in self._works if self.comm is None and w is not None]
        self._works = []

    def close(self) -> None:
        hold_until_shutdown(self._finished_works)
        self._finished_works = []
        super().close()
