"""The cyclic partition schedule (F4) and the binary tree (F9), simulated in one process."""

from __future__ import annotations

import pytest

from phalanx.config import load_config
from phalanx.errors import ConfigError
from phalanx.exchange import messages as schedule
from phalanx.exchange.base import ExchangeConfig
from phalanx.exchange.tree import tree_children, tree_parent

WORLD_SIZES = range(1, 33)


@pytest.mark.parametrize("p", WORLD_SIZES)
def test_cycles_use_disjoint_pairs(p: int) -> None:
    for phase in (schedule.reduce_cycles(p), schedule.broadcast_cycles(p)):
        assert len(phase) == p - 1
        for cycle in phase:
            ranks = [r for t in cycle for r in (t.src, t.dst)]
            assert len(ranks) == len(set(ranks)), f"p={p}: a rank is in two pairs: {cycle}"


def test_document_formulas_for_even_world() -> None:
    p, n = 8, 4  # 2N GPUs, N partitions
    assert schedule.num_partitions(p) == n
    for k, cycle in enumerate(schedule.reduce_cycles(p)):
        assert [(t.src, t.dst) for t in cycle] == [
            ((2 * m + k + 1) % p, (2 * m + k + 2) % p) for m in range(n)
        ]
    for k, cycle in enumerate(schedule.broadcast_cycles(p)):
        assert [(t.src, t.dst) for t in cycle] == [
            ((2 * m + k) % p, (2 * m + k + 1) % p) for m in range(n)
        ]


@pytest.mark.parametrize("p", WORLD_SIZES)
def test_each_partition_is_fully_reduced_at_its_owner_and_reaches_everyone(p: int) -> None:
    n = schedule.num_partitions(p)
    # holdings[r][m]: the set of ranks whose gradient of partition m rank r's copy contains.
    holdings = [[{r} for _ in range(n)] for r in range(p)]
    for cycle in schedule.reduce_cycles(p):
        for t in cycle:
            holdings[t.dst][t.partition] = (
                holdings[t.dst][t.partition] | holdings[t.src][t.partition]
            )
    for m in range(n):
        assert holdings[schedule.owner(m, p)][m] == set(range(p)), f"p={p} partition {m}"
    has = [{m for m in range(n) if schedule.owner(m, p) == r} for r in range(p)]
    for cycle in schedule.broadcast_cycles(p):
        for t in cycle:
            assert t.partition in has[t.src], f"p={p}: rank {t.src} sends what it lacks"
            has[t.dst].add(t.partition)
    assert all(h == set(range(n)) for h in has), f"p={p}: {has}"


@pytest.mark.parametrize("p", WORLD_SIZES)
def test_tree_sums_everything_at_the_root_and_sends_it_back(p: int) -> None:
    partial = [{r} for r in range(p)]
    for level in range(6):  # children of a node are in round order; simulate rounds bottom-up
        for r in range(p):
            for child in tree_children(r, p):
                if (child - r).bit_length() - 1 == level:
                    assert tree_parent(child) == r
                    partial[r] |= partial[child]
    assert partial[0] == set(range(p))
    reached = {0}
    frontier = [0]
    while frontier:
        node = frontier.pop()
        for child in tree_children(node, p):
            reached.add(child)
            frontier.append(child)
    assert reached == set(range(p))


def test_unknown_strategy_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match="allreduce.*partitioned.*ps.*tree"):
        load_config(None, ["exchange.strategy=ring"])


def test_option_a_strategy_does_not_take() -> None:
    with pytest.raises(ConfigError, match=r"exchange.options: strategy 'allreduce' takes no"):
        load_config(None, ["exchange.options={servers=1}"])
    with pytest.raises(ConfigError, match=r"exchange.options.servers: unknown key"):
        load_config(None, ["exchange.strategy=partitioned", "exchange.options={servers=1}"])
    with pytest.raises(ConfigError, match=r"exchange.options.reduce: got 'ring'"):
        load_config(None, ["exchange.strategy=ps", "exchange.options={reduce='ring'}"])


def test_servers_must_leave_a_worker() -> None:
    config = ExchangeConfig(strategy="ps", options={"servers": 2})
    config.check_world(3)
    with pytest.raises(ConfigError, match="servers: 2 servers leave no worker in a world of 2"):
        config.check_world(2)
