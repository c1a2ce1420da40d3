"""Messages on links: the simulation against closed forms, contention and compression."""

from __future__ import annotations

import dataclasses
import math

import pytest

from phalanx.exchange.messages import GRAD, Builder, cyclic_rounds, ring_rounds
from phalanx.exchange.messages import make_wire_codec as make_codec
from phalanx.exchange.param_server import ps_rounds
from phalanx.exchange.tree import tree_rounds
from phalanx.planner.cluster import ClusterConfig, LinkConfig
from phalanx.planner.network import Network

ALPHA, BETA = 20e-6, 2e9


def cluster(
    devices_per_node: int = 64,
    shared_nic: bool = True,
    inter_beta: float = BETA,
    codec_s_per_byte: float = 0.0,
) -> ClusterConfig:
    return ClusterConfig(
        name="test",
        devices_per_node=devices_per_node,
        intra=LinkConfig(alpha_s=ALPHA, beta_bytes_per_s=BETA),
        inter=LinkConfig(alpha_s=ALPHA, beta_bytes_per_s=inter_beta),
        shared_nic=shared_nic,
        codec_s_per_byte=codec_s_per_byte,
    )


def seconds(table, world: int, nbytes: float, net: Network) -> float:
    return net.seconds(table, world, [nbytes])[0]


@pytest.mark.parametrize("p", [2, 3, 5, 8, 16])
def test_ring_closed_form(p):
    net, n = Network(cluster(), make_codec("none")), 3e6
    expected = 2 * (p - 1) * ALPHA + 2 * (p - 1) / p * n / BETA
    assert seconds(ring_rounds(p), p, n, net) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("p", [2, 3, 5, 8, 16])
def test_tree_closed_form(p):
    net, n = Network(cluster(), make_codec("none")), 3e6
    expected = 2 * math.ceil(math.log2(p)) * (ALPHA + n / BETA)
    assert seconds(tree_rounds(p), p, n, net) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_cyclic_closed_form(p):
    """docs/exchange.md: each phase is (p-1) (alpha + S / (N beta)), N = p/2 partitions."""
    net, n = Network(cluster(), make_codec("none")), 3e6
    expected = (p - 1) * (ALPHA + n / (p // 2) / BETA)
    assert seconds(cyclic_rounds(p, False), p, n, net) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("p", [2, 4])
def test_message_overhead_is_paid_by_every_message_in_series(p):
    """``message_overhead_s`` lengthens each message: a ring's 2(p-1) steps pay it 2(p-1)
    times, a tree's 2 ceil(log2 p) rounds that many."""
    h, n = 3e-4, 3e6
    plain = Network(cluster(), make_codec("none"))
    slow = Network(dataclasses.replace(cluster(), message_overhead_s=h), make_codec("none"))
    for table, rounds in (
        (ring_rounds(p), 2 * (p - 1)),
        (tree_rounds(p), 2 * math.ceil(math.log2(p))),
    ):
        extra = seconds(table, p, n, slow) - seconds(table, p, n, plain)
        assert extra == pytest.approx(rounds * h, rel=1e-9)


def test_ring_is_paced_by_its_slowest_link():
    """Two nodes of 4: every ring step waits for the step across the slower network."""
    slow = BETA / 4
    net, n, p = Network(cluster(4, inter_beta=slow), make_codec("none")), 4e6, 8
    expected = 2 * (p - 1) * (ALPHA + n / p / slow)
    assert seconds(ring_rounds(p), p, n, net) == pytest.approx(expected, rel=1e-9)


def test_a_shared_nic_serialises_inter_node_messages():
    """Ranks 0 and 1 (node 0) send to 2 and 3 (node 1) at once: one card carries both."""
    b = Builder()
    b.round([(0, 2, 1.0, GRAD), (1, 3, 1.0, GRAD)])
    table, n = b.table("pair"), 1e6
    shared = Network(cluster(2, shared_nic=True), make_codec("none"))
    own = Network(cluster(2, shared_nic=False), make_codec("none"))
    assert seconds(table, 4, n, own) == pytest.approx(ALPHA + n / BETA)
    assert seconds(table, 4, n, shared) == pytest.approx(2 * (ALPHA + n / BETA))
    # and the ring of 8 on 2 nodes is unaffected: one ring edge leaves each node
    assert seconds(ring_rounds(8), 8, n, shared) == pytest.approx(
        seconds(ring_rounds(8), 8, n, own)
    )


def test_incast_at_a_parameter_server():
    """A star push to one dedicated server: its incoming port takes the messages in turn."""
    p, n = 5, 1e6
    table = ps_rounds(p, (4,), (0, 1, 2, 3), "star", False)
    net = Network(cluster(), make_codec("none"))
    assert seconds(table, p, n, net) == pytest.approx(4 * (ALPHA + n / BETA))


def test_compression_halves_the_wire_and_pays_the_codec():
    p, n, codec_cost = 4, 8e6, 1e-10
    plain = seconds(ring_rounds(p), p, n, Network(cluster(), make_codec("none")))
    half = seconds(ring_rounds(p), p, n, Network(cluster(), make_codec("fp16")))
    chunk = n / p
    # reduce-scatter hops carry (chunk/2 + 4) bytes; all-gather hops forward the same
    expected = 2 * (p - 1) * (ALPHA + (chunk / 2 + 4) / BETA)
    assert half == pytest.approx(expected, rel=1e-9) and half < plain
    coded = Network(cluster(codec_s_per_byte=codec_cost), make_codec("fp16"))
    # encode + decode per reduce-scatter hop, decode only when forwarding
    extra = (p - 1) * chunk * codec_cost * (1.0 + 0.5)
    assert seconds(ring_rounds(p), p, n, coded) == pytest.approx(expected + extra, rel=1e-9)


def test_bytes_by_level():
    net = Network(cluster(4), make_codec("none"))
    moved = net.bytes(ring_rounds(8), 8, 8e6)
    # 2 of the 8 ring edges cross nodes, every step moves 1/8 of the bucket on each edge
    assert moved.inter == pytest.approx(2 * 14 * 1e6)
    assert moved.intra == pytest.approx(6 * 14 * 1e6)
    assert moved.max_sent_by_rank == pytest.approx(14 * 1e6)


def test_interpolation_matches_simulation():
    net = Network(cluster(4, inter_beta=BETA / 3), make_codec("none"))
    curve = net.interpolated(ring_rounds(8), 8, 64e6)
    for n in (5e4, 3.3e6, 40e6):
        assert curve(n) == pytest.approx(seconds(ring_rounds(8), 8, n, net), rel=1e-6)


def test_a_shared_medium_serialises_a_nodes_messages() -> None:
    """shared_intra: a ring allreduce's p concurrent messages per step take turns, so with the
    from_link conversion (p beta, alpha / p) it costs what the calibration fitted, while a
    tree's one-way messages cost half of their full-duplex time at p = 2."""
    from phalanx.exchange.link import LinkModel
    from phalanx.exchange.messages import make_wire_codec as make_codec
    from phalanx.planner.cluster import from_link
    from phalanx.planner.network import Network

    alpha, beta, n = 1e-4, 1e9, 8e6
    cluster = from_link(
        LinkModel(alpha_s=alpha, beta_bytes_per_s=beta, world_size=2, backend="gloo")
    )
    network = Network(cluster, make_codec("none"))
    ring = network.seconds(ring_rounds(2), 2, [n])[0]
    assert ring == pytest.approx(2 * alpha + n / beta, rel=1e-9)  # the fitted line
    tree = network.seconds(tree_rounds(2), 2, [n])[0]
    assert tree == pytest.approx(2 * (alpha / 2 + n / (2 * beta)), rel=1e-9)
