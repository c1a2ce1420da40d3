"""This machine as a cluster, measured once and cached per host: what ``phalanx plan CONFIG``
plans on when no ``--cluster`` is given.

``calibrate_machine`` measures every term a ``ClusterConfig`` has on one machine:
  Phase 1 (the link): ``phalanx bench link``'s calibration (bench/link.py) on 2 worker
    processes, ``ROUNDS`` rounds, their median: alpha, beta, the message probe
    (``message_overhead_s``) and the hand-over probe (``handoff_s``), through ``from_link``;
  Phase 2 (this process): the fp16 codec's encode + decode-add and an uncompressed add, per
    byte (``measure_codec_s_per_byte``, ``measure_add_s_per_byte``: ~0.3 s together), and the
    cores the ranks share (``os.cpu_count()``; one rank per core, ``devices_per_node``);
  Phase 3 (k processes at once): the compute slow-down of ranks sharing the node
    (``measure_compute_slowdown``: a reference step in k processes against one alone, in
    many pairs of neighbouring windows);
  Phase 4 (1, 2 and 3 processes): what a fully_shard collective costs its rank beyond its
    transfer, in wall time at 2 ranks (``measure_collective_call_s``) and in CPU time with
    more ranks than cores (``measure_collective_call_cpu_s``).
What one machine cannot measure is a stated default, listed in the cluster's ``assumed``:
the link between machines (``ASSUMED_INTER``: 10 Gb/s Ethernet), so that plans past this
machine's cores (``--devices 1,2,4,...,1024``) say what they stand on. So is a probe of
Phases 3-4 that cannot measure (a loaded machine, a timeout): its default (no slow-down, 0 s),
in ``assumed`` and in one warning line (phalanx.optional); ``slowdown_now`` that cannot probe
keeps the cached factor the same way.

The cache: ``<cache dir>/clusters/<host>.json`` (cache dir: ``$PHALANX_CACHE_DIR``, else
``$XDG_CACHE_HOME/phalanx``, else ``~/.cache/phalanx``) holding the host, the UTC time it was
measured and the cluster (``ClusterConfig.to_dict``; ``cluster_from_dict`` reads it back
unchanged), written atomically. ``load_or_calibrate`` reuses it; ``recalibrate`` measures again.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from phalanx.bench.link import LinkBenchConfig, run_benchmark
from phalanx.errors import ConfigError
from phalanx.exchange.link import LinkModel
from phalanx.fileio import atomic_write_text, cache_dir
from phalanx.optional import optional
from phalanx.planner.cluster import (
    ClusterConfig,
    LinkConfig,
    cluster_from_dict,
    from_link,
    measure_add_s_per_byte,
    measure_codec_s_per_byte,
)

FORMAT = "phalanx.cluster/1"
NPROC = 2  # the link needs two ranks; more would oversubscribe a small machine's cores
ROUNDS = 3  # calibrations whose median is kept (~3 s each here)
REFERENCE_START_S = 4.0  # the first window opens this long after the processes are started
SLOWDOWN_WINDOW_S = 0.4  # one window of the compute slow-down probe (~150 reference steps)
SLOWDOWN_GAP_S = 0.05  # between windows: the last step of one ends before the next opens
SLOWDOWN_PAIRS = 16  # pairs of windows (alone, k together) per k: ~15 s at k <= 2
MAX_SLOWDOWN_RANKS = 8  # ranks per node the compute slow-down is measured for (more: the last)
# Between machines: nothing here measures it. 10 Gb/s Ethernet over TCP, as a plan's stated
# default: ~1.1 GB/s effective per direction, 50 us per message (kernel TCP round trips).
ASSUMED_INTER = LinkConfig(alpha_s=50e-6, beta_bytes_per_s=1.1e9)
INTER_NOTE = (
    "inter: not measured (one machine): 10 Gb/s Ethernet assumed (50 us + n / 1.1 GB/s); "
    "pass --cluster FILE with the real network"
)


@dataclass(kw_only=True)
class Calibration:
    """A cached (or fresh) calibration of one host."""

    host: str
    measured_at: str  # ISO 8601, UTC
    cluster: ClusterConfig
    path: Path
    fresh: bool = False  # measured by this call

    def describe(self) -> str:
        when = "measured now" if self.fresh else f"measured {self.measured_at[:16]} UTC"
        return (
            f"cluster: this machine ({self.host}), {when}, cached in {self.path} "
            "(--recalibrate measures again, --cluster FILE plans another)"
        )


def host_cores() -> int:
    """The cores this process may run on (its affinity; all of them where that is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def cache_path(host: str | None = None) -> Path:
    """The cached calibration of ``host`` (default: this one)."""
    host = host or socket.gethostname() or "localhost"
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in host)
    return cache_dir() / "clusters" / f"{safe}.json"


def measure_link(nproc: int = NPROC, rounds: int = ROUNDS) -> LinkModel:
    """Phase 1: the median LinkModel of ``rounds`` link calibrations on ``nproc`` workers."""
    result = run_benchmark(LinkBenchConfig(nproc=nproc, rounds=rounds, models=()))
    return LinkModel.from_dict(result["median"])


def slowdown_schedule(max_ranks: int, num_pairs: int) -> list[int]:
    """The ranks at work in each window of ``measure_compute_slowdown``: one warm-up window
    of every rank, then ``num_pairs`` rounds of one pair (1 alone, k together) for each k
    from 2 to ``max_ranks``, the pair's order flipped every round so that a drift of the
    machine's speed during a pair cancels out over the rounds."""
    windows = [max_ranks]
    for round_ in range(num_pairs):
        for ranks in range(2, max_ranks + 1):
            windows += [1, ranks] if round_ % 2 == 0 else [ranks, 1]
    return windows


def _reference_windows(rank: int, start_at: float, schedule: list[int]) -> list[float | None]:
    """One CPU rank's reference step (an MLP's forward, backward and Adam step on one intra-op
    thread, as phalanx runs a CPU rank) in each window of ``schedule`` (the ranks at work in
    it; window i runs ``SLOWDOWN_WINDOW_S`` from the wall-clock time ``start_at + i *
    (SLOWDOWN_WINDOW_S + SLOWDOWN_GAP_S)``, the same for every process): this rank's median
    step in seconds, or None where it rests (``rank`` >= the window's ranks) or started late."""
    import time

    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(512, 512) for _ in range(4)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.GELU())])
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 512)

    def step() -> None:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):  # warm-up: the allocator and the optimizer's state
        step()
    medians: list[float | None] = []
    for window, ranks in enumerate(schedule):
        opens = start_at + window * (SLOWDOWN_WINDOW_S + SLOWDOWN_GAP_S)
        closes = opens + SLOWDOWN_WINDOW_S
        while time.time() < opens:  # the others are still starting or in the gap: wait
            time.sleep(1e-3)
        if rank >= ranks or time.time() > opens + SLOWDOWN_GAP_S:
            medians.append(None)
            continue
        times = []
        while time.time() < closes:
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
        medians.append(statistics.median(times))
    return medians


def measure_compute_slowdown(cores: int, num_pairs: int = SLOWDOWN_PAIRS) -> tuple[float, ...]:
    """(1, t2 / t1, ..., tk / t1) for k up to ``cores`` (at most ``MAX_SLOWDOWN_RANKS``): the
    reference step in k processes at once against one process alone; the ranks of one node
    share its cores, caches and memory bandwidth, which slows each one's compute.

    One pool of k processes runs ``slowdown_schedule``'s windows: t_k / t_1 is taken within
    each pair of neighbouring windows (under a second apart), and the median over the pairs
    is kept. A shared machine's speed drifts by as much as the factor within seconds (on a
    2-core VM, one process alone: 0.4-s medians of 9.3-14 ms in one 20-s probe), so one
    window each for 1 and k ranks, seconds apart, measured the drift; many pairs close in
    time, in alternating order, cancel it. What they cannot cancel: the factor itself moves
    with the machine's other tenants (there, probes minutes apart read 1.04-1.17)."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor

    max_ranks = min(cores, MAX_SLOWDOWN_RANKS)
    if max_ranks < 2:
        return (1.0,)
    schedule = slowdown_schedule(max_ranks, num_pairs)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_ranks, mp_context=context) as pool:
        start_at = time.time() + REFERENCE_START_S  # after every process imported torch
        per_rank = list(pool.map(_reference_windows, range(max_ranks), [start_at] * max_ranks,
                                 [schedule] * max_ranks))  # fmt: skip
    return slowdown_factors(schedule, per_rank)


def slowdown_factors(schedule: list[int], per_rank: list[list[float | None]]) -> tuple[float, ...]:
    """(1, t2 / t1, ...) from the probe's windows: ``per_rank[rank][window]``, that rank's
    median step in seconds (None: it rested or started late) in each window of ``schedule``
    (``slowdown_schedule``'s). Within each pair of neighbouring windows, the mean step of the
    k ranks at work over the step of the one alone; the median over the pairs of each k."""
    ratios: dict[int, list[float]] = {k: [] for k in set(schedule) - {1}}
    for first in range(1, len(schedule), 2):  # window 0 warms up
        pair = {}
        for window in (first, first + 1):
            medians = [per_rank[rank][window] for rank in range(schedule[window])]
            if None not in medians:  # a rank started late: drop the pair
                pair[schedule[window]] = statistics.mean(m for m in medians if m is not None)
        if len(pair) == 2:
            ratios[max(pair)].append(pair[max(pair)] / pair[1])
    if not all(ratios.values()):
        raise RuntimeError(
            "the probe's processes started too late for every window (a loaded machine)"
        )
    # ranks together cannot compute faster than alone: a factor under 1 is the machine's noise
    return (1.0, *(max(1.0, statistics.median(ratios[k])) for k in sorted(ratios)))


def slowdown_now(cluster: ClusterConfig, say: Callable[[str], None] = print) -> ClusterConfig:
    """This host's cached cluster with its compute slow-down probed now
    (``measure_compute_slowdown``, ~20 s), as ``phalanx plan`` takes it beside the profile.

    The ranks of a CPU host share its cores with whatever else runs there, and that moves the
    factor while the other terms hold: on this project's 2-core VM, 16 probes within 75
    minutes read 1.03-1.22 for 2 ranks, and predictions with a calibration's 1.01 were 16%
    too fast at 2-3 processes where the same predictions with the factor probed before each
    config's runs were 8% too fast (docs/planner.md). A cached value is a moment of the
    machine; the plan's own moment is closer to the run it predicts."""
    cores = cluster.host_cores_per_node
    if cores < 2:  # one core: ranks take turns (compute_slowdown_at), nothing to probe
        return cluster
    cached = cluster.compute_slowdown[1] if len(cluster.compute_slowdown) > 1 else 1.0
    notes: list[str] = []  # a probe that cannot measure: the cached factor, stated
    factors = optional(
        lambda: measure_compute_slowdown(cores),
        cluster.compute_slowdown,
        what="compute slow-down not probed now",
        instead=f"the calibration's {cached:.2f} at 2 ranks used instead",
        again="phalanx plan CONFIG probes it again (on a less loaded machine)",
        notes=notes,
    )
    if notes:
        return replace(cluster, assumed=(*cluster.assumed, f"compute_slowdown: {notes[0]}"))
    say(f"compute slow-down probed now: {factors[1]:.2f} at 2 ranks (calibration: {cached:.2f})")
    return replace(cluster, compute_slowdown=factors)


CALL_UNITS = 8  # tiny fully_shard units of the collective-call probe


def _pin_to(cores: tuple[int, ...]) -> None:
    """Every thread of this process (Gloo's, started at init, included) on ``cores``."""
    for task in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(task), cores)


def _tiny_fsdp_step_s(ctx: Any, cores: tuple[int, ...] = ()) -> tuple[float, float]:
    """The median step of ``CALL_UNITS`` tiny fully_shard units (16 x 16 Linear: the bytes
    moved are nothing) on this rank, one intra-op thread: (wall seconds, CPU seconds of all
    the process's threads). ``cores``: run on these cores only (empty: where it is)."""
    import time

    import torch
    from torch.distributed.fsdp import fully_shard

    if cores:
        _pin_to(cores)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(CALL_UNITS)])
    for layer in model:
        fully_shard(layer, mesh=None)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 16)
    walls, cpus = [], []
    for step in range(40):
        started, cpu_started = time.perf_counter(), time.process_time()
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step >= 10:
            walls.append(time.perf_counter() - started)
            cpus.append(time.process_time() - cpu_started)
    return statistics.median(walls), statistics.median(cpus)


def measure_collective_call_s(alpha_s: float) -> float:
    """Seconds a fully_shard collective costs its rank's compute thread per ring step beyond
    the link's latency ``alpha_s``: a tiny model's step at 2 ranks minus alone, over its 3
    collectives per unit (all-gather, again before backward, reduce-scatter); measured here
    0.9-1.6 ms on Gloo (latency 0.1-0.15 ms)."""
    from phalanx.runtime.spawn import run_ranks

    alone = run_ranks(_tiny_fsdp_step_s, 1, timeout=120)[0][0]
    together = max(wall for wall, _ in run_ranks(_tiny_fsdp_step_s, NPROC, timeout=120))
    per_call = (together - alone) / (3 * CALL_UNITS) / (NPROC - 1)
    return max(0.0, per_call - alpha_s)


def measure_collective_call_cpu_s() -> float:
    """CPU seconds a fully_shard collective costs its rank per ring step with more ranks than
    cores: the tiny model's CPU time per step (all of a rank's threads) at 3 ranks pinned to
    2 cores (1 core: 2 ranks on it) minus alone, over its 3 collectives per unit and the
    ring steps; measured here 0.9-1.1 ms on Gloo."""
    from phalanx.runtime.spawn import run_ranks

    cores = tuple(sorted(os.sched_getaffinity(0)))[:2] if hasattr(os, "sched_getaffinity") else ()
    ranks = len(cores) + 1 if cores else NPROC + 1
    alone = run_ranks(_tiny_fsdp_step_s, 1, cores, timeout=120)[0][1]
    shared = statistics.mean(cpu for _, cpu in run_ranks(_tiny_fsdp_step_s, ranks, cores,
                                                         timeout=120))  # fmt: skip
    return max(0.0, (shared - alone) / (3 * CALL_UNITS) / (ranks - 1))


def calibrate_machine(
    measure: Callable[[], Any] = measure_link,
    codec: Callable[[], float] = measure_codec_s_per_byte,
    add: Callable[[], float] = measure_add_s_per_byte,
    slowdown: Callable[[int], tuple[float, ...]] = measure_compute_slowdown,
    calls: Callable[[float], float] = measure_collective_call_s,
    call_cpu: Callable[[], float] = measure_collective_call_cpu_s,
) -> ClusterConfig:
    """This machine as a cluster of identical machines, every term measured or stated (see
    the module doc). ``measure``, ``codec``, ``add``, ``slowdown``, ``calls``, ``call_cpu``:
    the measurements (tests replace them)."""
    link = measure()
    cores = host_cores()
    # Repeat the host measurements (the fsdp probes too, below): one sample on a shared machine
    # can be a scheduler's hiccup.
    codec_s = statistics.median(codec() for _ in range(3))
    add_s = statistics.median(add() for _ in range(3))
    cluster = from_link(
        link,
        name="this machine",
        devices_per_node=max(link.world_size, cores),  # CPU ranks: one per core
        codec_s_per_byte=codec_s,
        add_s_per_byte=add_s,
        host_cores=cores,
    )
    notes: list[str] = []  # the probes that could not measure (a loaded machine): stated

    def probe(term: str, run: Callable[[], Any], fallback: Any, value: str) -> Any:
        again = "phalanx plan CONFIG --recalibrate measures again"
        return optional(run, fallback, what=f"{term}: not measured", instead=f"{value} assumed",
                        again=again, notes=notes)  # fmt: skip

    return replace(
        cluster,
        # many pairs of windows inside: no repeats
        compute_slowdown=probe("compute_slowdown", lambda: slowdown(cores), (1.0,), "1.0"),
        collective_call_s=probe(
            "collective_call_s",
            lambda: statistics.median(calls(cluster.intra.alpha_s) for _ in range(3)),
            0.0,
            "0",
        ),
        collective_call_cpu_s=probe(
            "collective_call_cpu_s",
            lambda: statistics.median(call_cpu() for _ in range(3)),
            0.0,
            "0",
        ),
        nodes=0,  # as many such machines as a plan asks for, joined by the assumed network
        inter=ASSUMED_INTER,
        assumed=(*cluster.assumed, INTER_NOTE, *notes),
        description=f"{cluster.description}; codec and add measured on one process; "
        f"{cores} cores (this process's affinity)",
    )


def save_calibration(cluster: ClusterConfig, path: Path, host: str, when: datetime) -> None:
    data = {
        "format": FORMAT,
        "host": host,
        "measured_at": when.astimezone(timezone.utc).isoformat(timespec="seconds"),
        "cluster": cluster.to_dict(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def load_calibration(path: Path) -> Calibration:
    """A cached calibration; one-line ConfigError naming the file and the fix if it is bad."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable calibration ({e}); run with --recalibrate") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"{path}: not a {FORMAT} calibration; run with --recalibrate")
    cluster = cluster_from_dict(data.get("cluster") or {}, str(path))
    return Calibration(
        host=str(data.get("host", "")),
        measured_at=str(data.get("measured_at", "")),
        cluster=cluster,
        path=path,
    )


def _terms_lacking(path: Path) -> list[str]:
    """The cluster terms a cached calibration file does not hold (a cache written before
    phalanx measured them would otherwise read them as their defaults: a silent 0)."""
    held = json.loads(path.read_text(encoding="utf-8"))["cluster"]
    return [f.name for f in fields(ClusterConfig) if f.name not in held]


def load_or_calibrate(
    recalibrate: bool = False,
    say: Callable[[str], None] = print,
    calibrate: Callable[[], ClusterConfig] | None = None,
) -> Calibration:
    """This host's cached calibration, or a new one (measured, cached, then returned)."""
    path = cache_path()
    if path.is_file() and not recalibrate:
        cached = load_calibration(path)
        lacking = _terms_lacking(path)
        if not lacking:
            return cached
        say(f"{path} lacks {', '.join(lacking)} (measured by a newer phalanx): measuring again")
    say(f"calibrating this machine once (the link on {NPROC} processes, the codec, the add, "
        f"ranks sharing the cores, fsdp's calls; ~2 min), cached in {path}")  # fmt: skip
    host, when = socket.gethostname() or "localhost", datetime.now(timezone.utc)
    cluster = (calibrate or calibrate_machine)()
    save_calibration(cluster, path, host, when)
    calibration = load_calibration(path)  # what later runs will read, exactly
    return replace(calibration, fresh=True)
