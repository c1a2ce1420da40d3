"""Message schedules: the same messages as phalanx's strategies send, and their registry."""

from __future__ import annotations

import math

import numpy as np
import pytest

from phalanx.errors import ConfigError
from phalanx.exchange import messages as cyclic
from phalanx.exchange.messages import cyclic_rounds, ring_rounds
from phalanx.exchange.messages import make_wire_codec as make_codec
from phalanx.exchange.param_server import ps_rounds
from phalanx.exchange.tree import tree_children, tree_parent, tree_rounds
from phalanx.planner.exchanges import (
    FORWARD,
    FORWARD_PASS,
    GRAD,
    PARAM,
    SCHEDULES,
    STEP,
    make_schedule,
)


def sent_per_rank(table, world: int, nbytes: float = 1.0) -> np.ndarray:
    return np.bincount(table.src, weights=table.fraction * nbytes, minlength=world)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8, 9])
def test_ring_rounds(p):
    table = ring_rounds(p)
    assert table.num_rounds == 2 * (p - 1)
    rounds = table.rounds(1200.0)
    for messages in rounds:
        assert sorted((m.src, m.dst) for m in messages) == [(r, (r + 1) % p) for r in range(p)]
        assert all(m.nbytes == pytest.approx(1200.0 / p) for m in messages)
    assert np.allclose(sent_per_rank(table, p), 2 * (p - 1) / p)  # docs/exchange.md's volume


@pytest.mark.parametrize("p", range(2, 17))
def test_cyclic_rounds_are_the_documents_schedule(p):
    for send_back, cycles in ((False, cyclic.reduce_cycles(p)), (True, cyclic.broadcast_cycles(p))):
        table = cyclic_rounds(p, send_back)
        got = [sorted((m.src, m.dst) for m in r) for r in table.rounds(1.0)]
        assert got == [sorted((t.src, t.dst) for t in cycle) for cycle in cycles]
        kinds = set(table.kind.tolist())
        assert kinds == ({PARAM} if send_back else {GRAD})
        # half duplex: within a cycle a rank only sends or only receives
        for r in table.rounds(1.0):
            ranks = [m.src for m in r] + [m.dst for m in r]
            assert len(ranks) == len(set(ranks))


@pytest.mark.parametrize("p", range(2, 20))
def test_tree_rounds_follow_phalanx_tree(p):
    rounds = tree_rounds(p).rounds(1.0)
    depth = math.ceil(math.log2(p))
    assert len(rounds) == 2 * depth
    up = [(m.src, m.dst) for r in rounds[:depth] for m in r]
    assert sorted(up) == sorted((r, tree_parent(r)) for r in range(1, p))
    down = [(m.src, m.dst) for r in rounds[depth:] for m in r]
    assert sorted(down) == sorted((tree_parent(r), r) for r in range(1, p))
    # each rank forwards down to its children farthest first, as tree_allreduce does
    for rank in range(p):
        order = [dst for src, dst in down if src == rank]
        assert order == list(reversed(tree_children(rank, p)))
    # coded as tree_allreduce codes: every partial sum up, the root's sum once, then passed on
    assert {m.kind for r in rounds[:depth] for m in r} == {GRAD}
    assert [m.kind for m in rounds[depth]] == [GRAD]
    assert {m.kind for r in rounds[depth + 1 :] for m in r} <= {FORWARD}


def test_ps_star_push_and_pull():
    """One round each, in the strategy's turns (star_turn): turn t pairs worker w with server
    (w + t) mod 3, so within a turn every rank sends one message and receives one."""
    owners = workers = (0, 1, 2)
    push = ps_rounds(3, owners, workers, "star", False).rounds(3.0)
    assert len(push) == 1
    turns = [(0, 1), (1, 2), (2, 0), (0, 2), (1, 0), (2, 1)]
    assert [(m.src, m.dst) for m in push[0]] == turns
    assert all(m.nbytes == pytest.approx(1.0) and m.kind == GRAD for m in push[0])
    pull = ps_rounds(3, owners, workers, "star", True).rounds(3.0)
    assert [(m.src, m.dst) for m in pull[0]] == [(dst, src) for src, dst in turns]
    assert len(pull) == 1 and all(m.kind == PARAM for m in pull[0])
    # a binary tree over [server 4, workers 0..3]: positions 1..4 are ranks 0..3
    tree = ps_rounds(5, (4,), (0, 1, 2, 3), "tree", False).rounds(4.0)
    assert [[(m.src, m.dst) for m in r] for r in tree] == [[(0, 4), (2, 1)], [(1, 4)], [(3, 4)]]
    assert all(m.nbytes == 4.0 for r in tree for m in r)  # one partition: the whole bucket


def test_schedule_phases():
    codec = make_codec("none")
    allreduce = make_schedule("allreduce")
    assert allreduce.bucket_phases(1, codec, 1e6) == []
    assert [p.name for p in allreduce.bucket_phases(4, codec, 1e6)] == ["allreduce"]
    fp16 = make_codec("fp16")
    assert [p.name for p in allreduce.bucket_phases(2, fp16, 1e6)] == ["gather"]  # small, p=2
    assert [p.name for p in allreduce.bucket_phases(2, fp16, 1e8)] == ["allreduce"]
    partitioned = make_schedule("partitioned")
    assert partitioned.optimizer_fraction(8) == pytest.approx(1 / 4)
    assert [p.gates for p in partitioned.return_phases(8)] == [FORWARD_PASS]
    native = make_schedule("partitioned", {"schedule": "native"})
    assert native.optimizer_fraction(8) == pytest.approx(1 / 8)
    ps = make_schedule("ps", {"servers": 2, "reduce": "tree"})
    assert ps.num_trainers(6) == 4 and ps.optimizer_fraction(6) == 0.0
    phases = ps.bucket_phases(6, codec, 1e6)
    assert [(p.name, p.gates) for p in phases] == [
        ("push", STEP),
        ("update", STEP),
        ("pull", FORWARD_PASS),
    ]
    assert phases[1].update_fraction == pytest.approx(1 / 2)
    with pytest.raises(ConfigError, match="servers"):
        ps.check_world(2)


def test_registry_and_options():
    assert {"allreduce", "ring", "tree", "partitioned", "ps"} <= set(SCHEDULES.names())
    with pytest.raises(ConfigError, match="known: "):
        make_schedule("gossip")
    with pytest.raises(ConfigError, match="exchange.options.servers"):
        make_schedule("ps", {"servers": -1})
    with pytest.raises(ConfigError, match="schedule"):
        make_schedule("partitioned", {"schedule": "zigzag"})
    with pytest.raises(ConfigError, match="known: "):
        make_codec("int4")


def test_fp16_halves_gradients_only():
    fp16, none = make_codec("fp16"), make_codec("none")
    assert fp16.wire_bytes(1000.0, GRAD) == pytest.approx(504.0)  # half, plus the 4-byte scale
    assert fp16.wire_bytes(1000.0, PARAM) == 1000.0  # parameters travel exact
    assert none.wire_bytes(1000.0, GRAD) == 1000.0
    assert fp16.compresses and not none.compresses
