"""Point-to-point allreduce (phalanx.exchange.ring) on Gloo against the exact sum: the ring and
the gather, with and without compression, split into many pieces, at p = 2 and 3."""

from __future__ import annotations

import pytest
import torch

import phalanx as px
from phalanx.exchange import ring
from phalanx.exchange.compression import make_codec
from phalanx.exchange.sharding import bounds
from tests.helpers.spawn import run_ranks

SIZES = (1, 7, 1000, 4099)  # 4099 elements are 5 pieces of <= 1000: uneven chunks and pieces


def _local(rank: int, numel: int) -> torch.Tensor:
    """This rank's gradient: mixed magnitudes so each piece gets its own scale."""
    g = torch.Generator().manual_seed(1000 * rank + numel)
    return torch.randn(numel, generator=g) * torch.logspace(-6, 3, numel)


def _sums(ctx: px.Context) -> dict:
    ring.PIECE_NUMEL = 1000  # many pieces per chunk (the default would be one)
    rank, p, group = ctx.rank, ctx.world_size, ctx.group
    out: dict = {}
    for codec_name in ("none", "fp16", "bf16"):
        codec = make_codec(codec_name)
        for algorithm in (ring.ring_allreduce, ring.gather_allreduce, ring.p2p_allreduce):
            for numel in SIZES:
                flat = _local(rank, numel)
                sent, received = algorithm(flat, rank, p, group, codec)
                out[(codec_name, algorithm.__name__, numel)] = (flat, sent, received)
        for numel in SIZES:  # reduce-scatter: only this rank's chunk is complete
            flat = _local(rank, numel)
            ring.ring_reduce_scatter(flat, bounds(numel, p), rank, p, group, codec)
            lo, hi = bounds(numel, p)[rank]
            out[(codec_name, "reduce_scatter", numel)] = (flat[lo:hi].clone(), lo, hi)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_p2p_allreduce_equals_the_sum(world_size: int) -> None:
    results = run_ranks(_sums, world_size)
    # One rounding per hop: at most p unit roundoffs of the largest partial sum.
    roundoff = {"none": 1e-7, "fp16": 2.0**-11, "bf16": 2.0**-8}
    for key, value in results[0].items():
        codec_name, algorithm, numel = key
        exact = sum(_local(r, numel) for r in range(world_size))
        bound = (
            world_size
            * roundoff[codec_name]
            * sum(_local(r, numel).abs() for r in range(world_size)).max().item()
        )
        if algorithm == "reduce_scatter":
            for rank, r in enumerate(results):
                got, lo, hi = r[key]
                err = (got - exact[lo:hi]).abs().max().item() if hi > lo else 0.0
                assert err <= bound, (key, rank, err, bound)
            continue
        got = value[0]
        err = (got - exact).abs().max().item()
        assert err <= bound, (key, err, bound)
        assert torch.isfinite(got).all(), key
        for rank, r in enumerate(results):  # every rank holds the very same values
            assert torch.equal(r[key][0], got), (key, rank)
        sent, received = value[1], value[2]
        if codec_name != "none" and numel >= 1000:  # bytes: about half of float32's
            volume = numel * 4 * (2 * (world_size - 1) / world_size)
            if algorithm == "gather_allreduce":
                volume = numel * 4 * (world_size - 1)
            assert 0.45 * volume < sent < 0.55 * volume, (key, sent, volume)
            assert received == sent, key


def test_pieces_cover_the_range_in_order() -> None:
    assert ring.pieces(5, 5) == [(5, 5)]
    parts = ring.pieces(3, 3 + 2 * ring.PIECE_NUMEL + 1)
    assert len(parts) == 3 and parts[0][0] == 3 and parts[-1][1] == 3 + 2 * ring.PIECE_NUMEL + 1
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    assert max(b - a for a, b in parts) <= ring.PIECE_NUMEL
