"""Messages on links: a discrete-event simulation of one phase's rounds on a cluster (the model of
the wire, rendezvous and ports: docs/planner.md, "Messages on links").

Phases of ``Network.seconds``:
  Phase 1 (place): each message's level and ports, from the placement of its ranks.
  Phase 2 (level): rounds sharing no rank into levels, a level into waves without port conflicts.
  Phase 3 (run): wave by wave, vectorised over messages and bucket sizes, each message's end.
Both compile phases are cached per (table, placement), so one table serves every bucket size."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from phalanx.exchange.messages import RoundTable, WireCodec
from phalanx.planner.cluster import INTER, INTRA, ClusterConfig


@dataclass(frozen=True)
class Placement:
    """Where ``world`` ranks live: rank r on node r // devices_per_node."""

    world: int
    devices_per_node: int
    shared_nic: bool
    shared_intra: bool = False


@dataclass
class CompiledTable:
    """A RoundTable placed on a cluster: per message its level and ports; waves of messages
    (index arrays) in run order, grouped by level (``level_ends[k]``: waves of level k end)."""

    table: RoundTable
    placement: Placement
    inter: np.ndarray  # bool per message: crosses nodes
    out_port: np.ndarray
    in_port: np.ndarray
    waves: list[np.ndarray]
    level_of_wave: list[int]
    level_ranks: list[np.ndarray]
    simple_waves: list[bool]  # the wave's senders are distinct, and so are its receivers


def compile_table(table: RoundTable, placement: Placement) -> CompiledTable:
    """Phases 1 and 2 for one table on one placement."""
    p, dpn = placement.world, placement.devices_per_node
    src, dst = table.src, table.dst
    assert src.size == 0 or max(int(src.max()), int(dst.max())) < p, "rank beyond the world"
    # Phase 1: levels and ports. Ports: [0, p) intra out, [p, 2p) intra in, [2p, 3p) inter
    # out, [3p, 4p) inter in, indexed by node where the NIC is shared; [4p, 5p) a node's
    # shared intra-node medium.
    src_node, dst_node = src // dpn, dst // dpn
    inter = src_node != dst_node
    nic_src = src_node if placement.shared_nic else src
    nic_dst = dst_node if placement.shared_nic else dst
    out_port = np.where(inter, 2 * p + nic_src, src)
    in_port = np.where(inter, 3 * p + nic_dst, p + dst)
    if placement.shared_intra:  # one medium per node: both ends use the node's port
        out_port = np.where(inter, out_port, 4 * p + src_node)
        in_port = np.where(inter, in_port, 4 * p + src_node)
    # Phase 2: levels of rounds, then waves without port conflicts.
    level_of_round = _levels(table, p)
    counts = np.diff(table.starts)
    level_of_message = np.repeat(level_of_round, counts)
    order = np.argsort(level_of_message, kind="stable")
    num_levels = int(level_of_round.max(initial=-1)) + 1
    bounds = np.searchsorted(level_of_message[order], np.arange(num_levels + 1))
    waves: list[np.ndarray] = []
    level_of_wave: list[int] = []
    level_ranks: list[np.ndarray] = []
    for level in range(len(bounds) - 1):
        members = order[bounds[level] : bounds[level + 1]]
        if members.size == 0:
            continue
        level_ranks.append(np.unique(np.concatenate((src[members], dst[members]))))
        for wave in _waves(members, out_port, in_port):
            waves.append(wave)
            level_of_wave.append(len(level_ranks) - 1)
    return CompiledTable(
        table=table,
        placement=placement,
        inter=inter,
        out_port=out_port,
        in_port=in_port,
        waves=waves,
        level_of_wave=level_of_wave,
        level_ranks=level_ranks,
        simple_waves=[_distinct(src[w]) and _distinct(dst[w]) for w in waves],
    )


def _levels(table: RoundTable, world: int) -> np.ndarray:
    """Level of each round: one more than the latest level of any rank it involves.

    A rank's level is max(last[r], floor): a round that involves every rank raises ``floor``
    instead of touching each rank (a ring step), which keeps this linear in the messages of
    the other rounds."""
    last = [-1] * world
    floor = top = -1
    src, dst, starts = table.src.tolist(), table.dst.tolist(), table.starts.tolist()
    out = []
    for lo, hi in zip(starts, starts[1:]):
        ranks = set(src[lo:hi])
        ranks.update(dst[lo:hi])
        if len(ranks) == world:
            level = top + 1
            floor = level
        else:
            level = max(floor, max(last[r] for r in ranks)) + 1
            for r in ranks:
                last[r] = level
        top = max(top, level)
        out.append(level)
    return np.asarray(out, dtype=np.int64)


def _waves(members: np.ndarray, out_port: np.ndarray, in_port: np.ndarray) -> list[np.ndarray]:
    """Split one level's messages into waves in which every port appears at most once; a
    message goes to the first wave after every earlier message on either of its ports."""
    outs, ins = out_port[members], in_port[members]
    if _distinct(outs) and _distinct(ins):
        return [members]
    next_free: dict[int, int] = {}
    wave_of = []
    for o, i in zip(outs.tolist(), ins.tolist()):
        w = max(next_free.get(o, 0), next_free.get(i, 0))
        next_free[o] = next_free[i] = w + 1
        wave_of.append(w)
    wave_of_arr = np.asarray(wave_of)
    return [members[wave_of_arr == w] for w in range(int(wave_of_arr.max()) + 1)]


def _distinct(values: np.ndarray) -> bool:
    if values.size < 2:
        return True
    ordered = np.sort(values)
    return bool((ordered[1:] != ordered[:-1]).all())


@dataclass(frozen=True)
class PhaseBytes:
    """Wire bytes of one phase for one bucket, over all ranks, by link level."""

    intra: float
    inter: float
    max_sent_by_rank: float


@dataclass
class Network:
    """Runs phases of one cluster with one codec; caches compiled tables and results."""

    cluster: ClusterConfig
    codec: WireCodec
    _compiled: dict[tuple, CompiledTable] = field(default_factory=dict)
    _seconds: dict[tuple, float] = field(default_factory=dict)

    def placement(self, world: int) -> Placement:
        cluster = self.cluster
        return Placement(world, cluster.devices_per_node, cluster.shared_nic, cluster.shared_intra)

    def compiled(self, table: RoundTable, world: int) -> CompiledTable:
        key = (table.key, world)
        if key not in self._compiled:
            self._compiled[key] = compile_table(table, self.placement(world))
        return self._compiled[key]

    def seconds(self, table: RoundTable, world: int, sizes: list[float]) -> list[float]:
        """Duration of the phase for a bucket of each of ``sizes`` bytes (cached per size)."""
        known = self._seconds
        wanted = sorted({float(n) for n in sizes if (table.key, world, float(n)) not in known})
        if wanted:
            for n, t in zip(wanted, self._run(self.compiled(table, world), np.asarray(wanted))):
                self._seconds[(table.key, world, n)] = float(t)
        return [self._seconds[(table.key, world, float(n))] for n in sizes]

    def interpolated(self, table: RoundTable, world: int, max_bytes: float) -> Any:
        """A function n -> the phase's seconds for a bucket of n bytes, interpolated linearly
        between simulated sizes (64 B .. ``max_bytes``, 48 per decade and a half): for
        exchanges whose buckets are only known while the step runs (fusion cycles). Every
        message's time is affine in n, so the simulated time is piecewise linear in n and the
        interpolation is close."""
        grid = np.unique(np.geomspace(64.0, max(128.0, float(max_bytes)), 48).round())
        seconds = np.asarray(self.seconds(table, world, grid.tolist()))

        def curve(nbytes: float) -> float:
            if nbytes <= grid[-1]:
                return float(np.interp(nbytes, grid, seconds))
            slope = (seconds[-1] - seconds[-2]) / (grid[-1] - grid[-2])
            return float(seconds[-1] + slope * (nbytes - grid[-1]))

        return curve

    def _run(self, compiled: CompiledTable, sizes: np.ndarray) -> np.ndarray:
        """Phase 3: the simulation, one column per bucket size."""
        table, p = compiled.table, compiled.placement.world
        if table.num_messages == 0:
            return np.zeros(sizes.size)
        intra = self.cluster.link(INTRA)
        inter = self.cluster.link(INTER) if compiled.inter.any() else intra
        alpha = np.where(compiled.inter, inter.alpha_s, intra.alpha_s)
        inv_beta = np.where(
            compiled.inter, 1.0 / inter.beta_bytes_per_s, 1.0 / intra.beta_bytes_per_s
        )
        ratio = np.asarray(self.codec.ratio)[table.kind]
        overhead = np.asarray(self.codec.overhead_bytes)[table.kind]
        coding = np.asarray(self.codec.coding)[table.kind] * self.cluster.codec_s_per_byte
        if self.codec.separate_add:  # phalanx's receiver adds a reduced message itself
            coding = coding + table.summed * self.cluster.add_s_per_byte
        # seconds per message, whatever its size (the hosts' software path included)
        fixed = alpha + overhead * inv_beta + self.cluster.message_overhead_s
        per_byte = table.fraction * (ratio * inv_beta + coding)  # seconds per bucket byte
        done = np.zeros((p, sizes.size))  # when each rank finished its previous rounds
        level_done = np.zeros_like(done)  # rows of the current level's ranks: their latest end
        ports = np.zeros((5 * p, sizes.size))
        current = -1
        for wave, level, simple in zip(
            compiled.waves, compiled.level_of_wave, compiled.simple_waves
        ):
            if level != current:  # a new level: the previous one's rounds are complete
                if current >= 0:
                    ranks = compiled.level_ranks[current]
                    done[ranks] = level_done[ranks]
                current = level
                ranks = compiled.level_ranks[current]
                level_done[ranks] = done[ranks]
            s, d = table.src[wave], table.dst[wave]
            o, i = compiled.out_port[wave], compiled.in_port[wave]
            start = np.maximum(np.maximum(done[s], done[d]), np.maximum(ports[o], ports[i]))
            end = start + fixed[wave, None] + per_byte[wave, None] * sizes[None, :]
            ports[o] = end
            ports[i] = end
            if simple:  # no rank twice on one side: plain indexing is exact (and faster)
                level_done[s] = np.maximum(level_done[s], end)
                level_done[d] = np.maximum(level_done[d], end)
            else:
                np.maximum.at(level_done, s, end)
                np.maximum.at(level_done, d, end)
        if current >= 0:
            ranks = compiled.level_ranks[current]
            done[ranks] = level_done[ranks]
        return done.max(axis=0)

    def bytes(self, table: RoundTable, world: int, nbytes: float) -> PhaseBytes:
        """Wire bytes of the phase for one bucket of ``nbytes`` (uncompressed) bytes."""
        if table.num_messages == 0:
            return PhaseBytes(0.0, 0.0, 0.0)
        compiled = self.compiled(table, world)
        wire = table.fraction * np.asarray(self.codec.ratio)[table.kind] * nbytes
        wire = wire + np.asarray(self.codec.overhead_bytes)[table.kind]
        sent = np.bincount(table.src, weights=wire, minlength=world)
        return PhaseBytes(
            intra=float(wire[~compiled.inter].sum()),
            inter=float(wire[compiled.inter].sum()),
            max_sent_by_rank=float(sent.max()),
        )
