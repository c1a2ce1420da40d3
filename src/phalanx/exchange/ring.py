"""Ring reduce-scatter and allreduce over point-to-point messages, pipelined in pieces, where
the backend cannot sum (compressed messages carry per-rank scales; docs/exchange.md).

A ring step moves a chunk as pieces of ``PIECE_NUMEL``, so decoding overlaps the wire:
  Phase 1: post the receives of every piece of the incoming chunk;
  Phase 2: encode the outgoing pieces, then post every send (sending each as it was encoded
    measured slower on two shared cores);
  Phase 3: fold each incoming piece into ``flat`` as it arrives, in order (pairs deliver in order).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.exchange.comm import global_rank, wait_all
from phalanx.exchange.compression import Codec
from phalanx.exchange.sharding import bounds

PIECE_NUMEL = 1 << 19  # elements per message: 2 MiB of float32 (1 << 17..19 measured alike)

Range = tuple[int, int]
Combine = Callable[[torch.Tensor, torch.Tensor], None]  # (message, destination slice)


def pieces(lo: int, hi: int) -> list[Range]:
    """``[lo, hi)`` split into near-equal pieces of at most ``PIECE_NUMEL`` elements."""
    count = max(1, -(-(hi - lo) // PIECE_NUMEL))
    return [(lo + a, lo + b) for a, b in bounds(hi - lo, count)]


class RingLink:
    """This rank's place in a ring over ``group``: sends to rank+1, receives from rank-1."""

    def __init__(self, rank: int, world_size: int, group: Any, codec: Codec) -> None:
        self.rank, self.world_size, self.group, self.codec = rank, world_size, group, codec
        self.sent = self.received = 0

    def step(
        self,
        flat: torch.Tensor,
        send: Range,
        recv: Range,
        combine: Combine,
        recv_slot: str,
        outgoing: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Send ``flat[send]`` (or ``outgoing``), ``combine`` the received pieces; returns them."""
        codec, p = self.codec, self.world_size
        nxt, prev = (self.rank + 1) % p, (self.rank - 1) % p
        send_pieces, recv_pieces = pieces(*send), pieces(*recv)
        # Phase 1: every receive is posted before anything is sent.
        incoming = codec.message_views(recv_slot, [b - a for a, b in recv_pieces], flat)
        receives = [
            dist.irecv(m, global_rank(self.group, prev), group=self.group) for m in incoming
        ]
        # Phase 2: encode piece by piece, then send.
        if outgoing is None:
            buffers = codec.message_views("send", [b - a for a, b in send_pieces], flat)
            outgoing = [
                codec.encode(flat[a:b], out=buf) for (a, b), buf in zip(send_pieces, buffers)
            ]
        sends = [dist.isend(m, global_rank(self.group, nxt), group=self.group) for m in outgoing]
        # Phase 3: fold in what arrives, in order.
        for work, message, (a, b) in zip(receives, incoming, recv_pieces):
            assert work is not None  # None only on a rank outside the group
            work.wait()
            combine(message, flat[a:b])
        wait_all(sends)
        self.sent += sum(m.nbytes for m in outgoing)
        self.received += sum(m.nbytes for m in incoming)
        return incoming


def ring_reduce_scatter(
    flat: torch.Tensor,
    chunks: list[Range],
    rank: int,
    p: int,
    group: Any,
    codec: Codec,
    last: Combine | None = None,
) -> tuple[int, int]:
    """Sum ``flat`` so chunk ``rank`` is complete here (step s: send r-s-1, add r-s-2; the
    last step combines by ``last`` where given)."""
    link = RingLink(rank, p, group, codec)
    for s in range(p - 1):
        combine = last if last is not None and s == p - 2 else codec.decode_add
        link.step(flat, chunks[(rank - s - 1) % p], chunks[(rank - s - 2) % p], combine, "a")
    return link.sent, link.received


def ring_allreduce(
    flat: torch.Tensor, rank: int, p: int, group: Any, codec: Codec
) -> tuple[int, int]:
    """Sum ``flat`` (1-D) over the ring in place; returns this rank's (sent, received) bytes.
    Phase 1 (reduce-scatter): ``ring_reduce_scatter``; chunk r is complete at rank r.
    Phase 2 (all-gather): pass the owners' encoded chunks on unchanged (bit-identical replicas).
    """
    chunks = bounds(flat.numel(), p)
    # Phase 1: reduce-scatter.
    sent, received = ring_reduce_scatter(flat, chunks, rank, p, group, codec)
    # Phase 2: all-gather, forwarding messages unchanged.
    link = RingLink(rank, p, group, codec)
    own = pieces(*chunks[rank])
    buffers = codec.message_views("own", [b - a for a, b in own], flat)
    outgoing = [codec.encode(flat[a:b], out=m) for (a, b), m in zip(own, buffers)]
    for (a, b), message in zip(own, outgoing):  # the owner keeps what the others decode
        codec.decode_into(message, flat[a:b])
    for s in range(p - 1):
        recv = chunks[(rank - s - 1) % p]
        slot = "a" if s % 2 == 0 else "b"  # the messages being forwarded live in the other
        outgoing = link.step(flat, chunks[(rank - s) % p], recv, codec.decode_into, slot, outgoing)
    return sent + link.sent, received + link.received


class GatherExchange:
    """Sum ``flat`` (1-D) in place: every rank's whole message to every other, all p added in
    rank order (one round; the better trade at p = 2). ``start`` returns once all is posted:
      Phase 1 (start): post the receives of every piece from every other rank;
      Phase 2 (start): encode this rank's pieces, then send each to every other rank;
      Phase 3 (finish): per piece, once all p messages are there, decode them in rank order.
    """

    def __init__(self, flat: torch.Tensor, rank: int, p: int, group: Any, codec: Codec) -> None:
        self.flat, self.rank, self.p, self.group, self.codec = flat, rank, p, group, codec
        self.parts = pieces(0, flat.numel())
        self.messages: dict[int, list[torch.Tensor]] = {}
        self.receives: dict[int, list[Any]] = {}
        self.sends: list[Any] = []

    def start(self) -> GatherExchange:
        flat, rank, p, group, codec = self.flat, self.rank, self.p, self.group, self.codec
        numels = [b - a for a, b in self.parts]
        # Phase 1: every receive is posted before anything is sent.
        for src in range(p):
            if src != rank:
                self.messages[src] = codec.message_views(f"from{src}", numels, flat)
                self.receives[src] = [
                    dist.irecv(m, global_rank(group, src), group=group) for m in self.messages[src]
                ]
        # Phase 2: encode piece by piece, then send.
        buffers = codec.message_views("own", numels, flat)
        own = [codec.encode(flat[a:b], out=m) for (a, b), m in zip(self.parts, buffers)]
        if codec.wire_dtype is None:  # the messages are views of flat, which the sum overwrites
            own = [m.copy_(flat[a:b]) for (a, b), m in zip(self.parts, buffers)]
        self.messages[rank] = own
        self.sends = [
            dist.isend(m, global_rank(group, dst), group=group)
            for m in own
            for dst in range(p)
            if dst != rank
        ]
        return self

    def finish(self) -> tuple[int, int]:
        """Phase 3; returns this rank's (sent, received) bytes."""
        codec, flat = self.codec, self.flat
        for k, (a, b) in enumerate(self.parts):
            for works in self.receives.values():
                works[k].wait()
            codec.decode_into(self.messages[0][k], flat[a:b])
            for src in range(1, self.p):
                codec.decode_add(self.messages[src][k], flat[a:b])
        for work in self.sends:
            work.wait()
        sent = sum(m.nbytes for m in self.messages[self.rank]) * (self.p - 1)
        return sent, sent  # every rank's messages have the same sizes


def gather_allreduce(
    flat: torch.Tensor, rank: int, p: int, group: Any, codec: Codec
) -> tuple[int, int]:
    """``GatherExchange`` from start to finish; returns this rank's (sent, received) bytes."""
    return GatherExchange(flat, rank, p, group, codec).start().finish()


GATHER_MAX_BYTES = 2 << 20  # messages up to this go by gather at p = 2 (measured crossover)


def prefers_gather(flat: torch.Tensor, p: int, codec: Codec) -> bool:
    """Whether ``p2p_allreduce`` sums ``flat`` by gather (p = 2, small) rather than by ring."""
    return p == 2 and codec.message_nbytes(flat.numel(), flat) <= GATHER_MAX_BYTES


def p2p_allreduce(
    flat: torch.Tensor, rank: int, p: int, group: Any, codec: Codec
) -> tuple[int, int]:
    """Sum ``flat`` in place over point-to-point messages, by the cheaper algorithm."""
    if prefers_gather(flat, p, codec):
        return gather_allreduce(flat, rank, p, group, codec)
    return ring_allreduce(flat, rank, p, group, codec)
