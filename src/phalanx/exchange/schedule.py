"""The documents' cyclic partition schedule (F4), generalised to any number of ranks.

With p = 2N ranks the source splits the gradients into N partitions. In cycle k (k = 0..p-2)
partition m moves from rank i = (2m+k+1) mod p to rank j = (2m+k+2) mod p, which adds its own
copy: after p-1 cycles partition m has visited every rank and is fully reduced at its owner
2m. The broadcast phase then sends the updated partition m from a = (2m+k) mod p to
b = (2m+k+1) mod p, again p-1 cycles. Partition m's pair in cycle k is {2m+k+1, 2m+k+2};
pairs of different partitions start 2 ranks apart, so within a cycle they are disjoint and
every rank only sends or only receives.

For odd p = 2N+1 the same formulas with N = floor(p/2) partitions keep the pairs disjoint: the
start offsets 1, 3, ..., 2N-1 are at least 2 apart around the ring of p (the wrap-around gap is
3), so one rank idles each cycle. With p = 1 there is one partition and no cycle.
Derivation and cost: docs/exchange.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Transfer:
    """Partition ``partition`` travels from rank ``src`` to rank ``dst`` in one cycle."""

    partition: int
    src: int
    dst: int


def num_partitions(world_size: int) -> int:
    return max(1, world_size // 2)


def owner(partition: int, world_size: int) -> int:
    """The rank where partition m ends the reduce phase: 2m."""
    return (2 * partition) % world_size


def reduce_cycles(world_size: int) -> list[list[Transfer]]:
    """Cycle k's transfers of the reduce phase: i = (2m+k+1) % p -> j = (2m+k+2) % p."""
    p = world_size
    return [
        [Transfer(m, (2 * m + k + 1) % p, (2 * m + k + 2) % p) for m in range(num_partitions(p))]
        for k in range(p - 1)
    ]


def broadcast_cycles(world_size: int) -> list[list[Transfer]]:
    """Cycle k's transfers of the broadcast phase: a = (2m+k) % p -> b = (2m+k+1) % p."""
    p = world_size
    return [
        [Transfer(m, (2 * m + k) % p, (2 * m + k + 1) % p) for m in range(num_partitions(p))]
        for k in range(p - 1)
    ]
