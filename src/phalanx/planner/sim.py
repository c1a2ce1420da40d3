"""A discrete-event simulation of training steps: compute stream, buckets, communication stream.
One representative trainer rank is simulated; each bucket's exchange message by message over all
ranks (``network.Network``). The model in full: docs/planner.md, "The step".

Per step:
  Phase 1 (input, forward): input wait, layers in forward order, each waiting for its parameters.
  Phase 2 (backward): layers in backward order; buckets formed and launched as the Engine does.
  Phase 3 (exchange): the communication stream serves launched buckets, overlapping backward.
  Phase 4 (wait, optimizer): the step waits for the phases it needs, then the optimizer runs.
  Phase 5 (send back): owners send updated buckets back, overlapping the next forward.
Per-unit strategies (``fsdp``) replace Phases 2, 3 and 5 (``_Timeline.step_units``). Two steps
are simulated; the second (the steady state) is reported. ``predict_step``: a measured run in,
its predicted step out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from phalanx.errors import ConfigError
from phalanx.exchange.buckets import FIRST_BUCKET_BYTES, plan_buckets
from phalanx.exchange.messages import make_wire_codec
from phalanx.planner.cluster import ClusterConfig, from_link
from phalanx.planner.exchanges import (
    FORWARD_PASS,
    STEP,
    Phase,
    Schedule,
    UnitPhases,
    agreement_phases,
    make_schedule,
)
from phalanx.planner.network import Network
from phalanx.planner.step import StepProfile
from phalanx.planner.trace import (
    LANE_COMPUTE,
    LANE_EXCHANGE,
    LANE_INPUT,
    LANE_OPTIMIZER,
    LANE_WAIT,
    TraceEvent,
)

MIB = 2**20
DEFAULT_BUCKET_BYTES = 25 * MIB
FLAG_BYTES = 4  # each parameter's usage flag travels in its bucket (one float32 element)
MAX_ROUNDS = 40_000  # per phase and bucket: each round costs the simulation ~20 us at least
MAX_ROUND_MESSAGES = 70_000  # in one round: levelling a round costs more than its messages
NUM_STEPS = 2  # the first step warms the send-back up; the second is reported


class TooLarge(ConfigError):
    """A phase has more rounds than the simulation's budget (``max_rounds``)."""


@dataclass(kw_only=True)
class ExchangeSetup:
    """What is exchanged how: a strategy (a registered schedule) and its options, the fusion
    threshold, compression."""

    strategy: str = "allreduce"
    options: dict[str, Any] = field(default_factory=dict)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    compress: str = "none"
    first_bucket_bytes: int = FIRST_BUCKET_BYTES
    threshold_label: str = ""  # how bucket_bytes was chosen ("25 MiB", "auto"), for tables
    # 0: phalanx's buckets. > 0: Horovod's tensor fusion, to model published Horovod runs: a
    # background loop wakes every cycle (or when the previous exchange ends, if later) and
    # sends every gradient ready by then, up to bucket_bytes per message.
    fusion_cycle_s: float = 0.0

    def label(self) -> str:
        options = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        name = f"{self.strategy}({options})" if options else self.strategy
        threshold = self.threshold_label or f"{self.bucket_bytes / MIB:.3g} MiB"
        return f"{name} / {threshold} / {self.compress}"


@dataclass(frozen=True)
class BucketPlan:
    """One fusion bucket: its gradients (indices in ready order) and their bytes."""

    index: int
    grads: tuple[int, ...]
    nbytes: int  # gradients plus one usage flag per parameter, as the Engine's buckets


def plan_step_buckets(
    profile: StepProfile, bucket_bytes: int, first_bucket_bytes: int = FIRST_BUCKET_BYTES
) -> list[BucketPlan]:
    """The Engine's buckets for this profile: ``plan_buckets`` over byte-sized stand-ins of the
    gradients in ready order (no memory: meta tensors, as threshold.py does)."""
    sizes = profile.grad_sizes
    if not sizes:
        return []
    stand_ins = [torch.empty(n, dtype=torch.uint8, device="meta") for n in sizes]
    groups = plan_buckets(stand_ins, bucket_bytes, first_bucket_bytes)
    return [
        BucketPlan(index=b, grads=tuple(g), nbytes=sum(sizes[i] for i in g) + FLAG_BYTES * len(g))
        for b, g in enumerate(groups)
    ]


def unit_plans(profile: StepProfile) -> list[BucketPlan]:
    """One unit per layer that has gradients (``Schedule.unit_phases``): its gradients and
    their bytes, which are its float32 parameters' bytes (no usage flags: units are not the
    Engine's buckets)."""
    sizes, first = profile.grad_sizes, 0
    plans: list[BucketPlan] = []
    for layer in profile.layers:
        count = len(layer.grad_bytes)
        if count:
            grads = tuple(range(first, first + count))
            plans.append(BucketPlan(len(plans), grads, sum(sizes[g] for g in grads)))
        first += count
    return plans


@dataclass(kw_only=True)
class StepResult:
    """The simulated steady-state step of one rank (seconds, bytes per step)."""

    world: int
    trainers: int
    setup: ExchangeSetup
    schedule: str
    step_s: float
    compute_s: float  # input wait, forward, backward and optimizer: the busy compute stream
    exposed_s: float  # the compute stream waiting for the exchange (step_s - compute_s)
    exchange_wait_s: float  # of which after backward, for buckets still on the wire
    parameter_wait_s: float  # of which in forward, for parameters still travelling back
    optimizer_s: float
    batch_size: int
    bytes_intra: float  # on intra-node links, all ranks together
    bytes_inter: float  # on inter-node links, all ranks together
    max_bytes_sent: float  # sent by one rank at most (each phase's busiest sender, summed)
    bucket_bytes: list[int]
    events: list[TraceEvent] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.trainers * self.batch_size / self.step_s

    def to_dict(self, events: bool = False) -> dict[str, Any]:
        out = {
            "world": self.world,
            "trainers": self.trainers,
            "strategy": self.setup.strategy,
            "options": self.setup.options,
            "bucket_bytes_threshold": self.setup.bucket_bytes,
            "threshold": self.setup.threshold_label or "fixed",
            "compress": self.setup.compress,
            "schedule": self.schedule,
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "exposed_s": self.exposed_s,
            "exchange_wait_s": self.exchange_wait_s,
            "parameter_wait_s": self.parameter_wait_s,
            "optimizer_s": self.optimizer_s,
            "samples_per_s": self.samples_per_s,
            "bytes_intra": self.bytes_intra,
            "bytes_inter": self.bytes_inter,
            "max_bytes_sent": self.max_bytes_sent,
            "buckets": self.bucket_bytes,
        }
        if events:
            out["events"] = [e.to_dict() for e in self.events]
        return out


class Simulator:
    """Simulates steps of one step profile on one cluster; setups share the message caches."""

    def __init__(
        self,
        profile: StepProfile,
        cluster: ClusterConfig,
        max_rounds: int = MAX_ROUNDS,
        max_round_messages: int = MAX_ROUND_MESSAGES,
        measured_beside_exchange: bool = False,
    ) -> None:
        """``measured_beside_exchange``: the profile's compute was measured in the very
        multi-process run being predicted (the oracle mode, ``predict_step``), so it already
        holds what communication took from it on shared cores: not taken again."""
        self.measured = profile  # as measured (per strategy: ``StepProfile.for_strategy``)
        self.profile = profile.scaled(cluster.compute_speed)
        self.measured_beside_exchange = measured_beside_exchange
        self.cluster = cluster
        self.max_rounds = max_rounds
        self.max_round_messages = max_round_messages
        self._networks: dict[str, Network] = {}
        layer_of_grad = [i for i, layer in enumerate(self.profile.layers) for _ in layer.grad_bytes]
        self._layer_of_grad = layer_of_grad

    def at(self, world: int, strategy: str | None = None) -> StepProfile:
        """The step's compute at ``world`` ranks under ``strategy`` (its Engine's own world-1
        step where the profile measured it): slower where ranks share a node's cores or
        memory bandwidth (``ClusterConfig.compute_slowdown``)."""
        profile = self.profile
        if strategy in self.measured.strategy_phases:
            profile = self.measured.for_strategy(strategy).scaled(self.cluster.compute_speed)
        slowdown = self.cluster.compute_slowdown_at(world)
        return profile if slowdown == 1.0 else profile.scaled(1.0 / slowdown)

    def network(self, compress: str) -> Network:
        if compress not in self._networks:
            self._networks[compress] = Network(self.cluster, make_wire_codec(compress))
        return self._networks[compress]

    # -- one setup ---------------------------------------------------------------------------
    def prefetch(self, world: int, setups: list[ExchangeSetup]) -> None:
        """Simulate the message phases of every bucket of ``setups`` in one vectorised run per
        table and codec, so that ``run`` finds them cached (what a sweep should call first).
        Setups over the round budget are left for ``run`` to report."""
        wanted: dict[tuple, tuple[Network, Any, list[float]]] = {}
        for setup in setups:
            schedule = make_schedule(setup.strategy, setup.options)
            network = self.network(setup.compress)
            if schedule.refuses(network.codec) or schedule.unit_phases(world) is not None:
                continue  # refused by ``run``; units are simulated by ``run`` alone
            buckets = plan_step_buckets(self.profile, setup.bucket_bytes, setup.first_bucket_bytes)
            for b in buckets:
                for phase in schedule.bucket_phases(world, network.codec, b.nbytes) + (
                    schedule.return_phases(world)
                ):
                    table = phase.table
                    if table is None or self._over_budget(phase, world, "bucket"):
                        continue
                    key = (setup.compress, table.key)
                    wanted.setdefault(key, (network, table, []))[2].append(b.nbytes)
        for network, table, sizes in wanted.values():
            network.seconds(table, world, sizes)

    def run(self, world: int, setup: ExchangeSetup) -> StepResult:
        """The steady-state step of ``setup`` on ``world`` ranks of the cluster."""
        self.cluster.check_devices(world)
        schedule = make_schedule(setup.strategy, setup.options)
        schedule.check_world(world)
        network = self.network(setup.compress)
        if why := schedule.refuses(network.codec):
            raise ConfigError(f"exchange.compress: {why}")
        # CPU ranks run on Gloo, whose reduce-scatter is an all-reduce (schedules.py)
        units = schedule.unit_phases(world, self.cluster.host_cores_per_node > 0)
        if units is not None:
            return self._run_units(world, setup, schedule, network, units)
        if setup.fusion_cycle_s > 0:
            return self._run_fused(world, setup, schedule, network)
        buckets = plan_step_buckets(self.profile, setup.bucket_bytes, setup.first_bucket_bytes)
        phases = [schedule.bucket_phases(world, network.codec, b.nbytes) for b in buckets]
        returns = schedule.return_phases(world)
        durations = self._durations(network, world, buckets, phases)
        return_durations = self._durations(network, world, buckets, [returns] * len(buckets))
        timeline = _Timeline(self.at(world, setup.strategy), buckets, self._layer_of_grad)
        timeline.agree_s = self._agree_s(network, world) if schedule.agrees_before_backward else 0.0
        timeline.handoff_s = self.cluster.handoff_s if world > 1 else 0.0
        timeline.on_thread = [
            schedule.on_thread(network.codec, b.index == len(buckets) - 1) for b in buckets
        ]
        timeline.returns_on_thread = bool(returns) and schedule.on_thread(network.codec, False)
        timeline.comm_rate = self.cluster.comm_rate_beside_compute(world)
        timeline.steals = not self.measured_beside_exchange
        if world > 1 and not schedule.loss_rides(network.codec) and timeline.steals:
            timeline.loss_s = self._agree_s(network, world)  # the same 1-message all-reduce
        for step in range(NUM_STEPS):
            timeline.step(
                step,
                phases,
                durations,
                returns,
                return_durations,
                schedule.optimizer_fraction(world),
            )
        moved = _moved(network, world, buckets, [ps + returns for ps in phases])
        return self._result(world, setup, schedule, timeline, moved, [b.nbytes for b in buckets])

    def _run_units(
        self,
        world: int,
        setup: ExchangeSetup,
        schedule: Schedule,
        network: Network,
        units: UnitPhases,
    ) -> StepResult:
        """A strategy that shards parameters per unit (``Schedule.unit_phases``): one unit per
        layer with parameters, its all-gathers around its compute, its reduce-scatter after
        its backward (``_Timeline.step_units``)."""
        plans = unit_plans(self.profile)

        def timed(phases: list[Phase]) -> list[list[tuple[Phase, float]]]:
            seconds = self._durations(network, world, plans, [phases] * len(plans))
            return [list(zip(phases, unit)) for unit in seconds]

        gather, regather, reduce = timed(units.gather), timed(units.regather), timed(units.reduce)
        timeline = _Timeline(self.at(world, setup.strategy), plans, self._layer_of_grad)
        timeline.comm_rate = self.cluster.comm_rate_beside_compute(world)
        timeline.steals = not self.measured_beside_exchange
        timeline.call_s = self.cluster.collective_call_s_at(world)
        for step in range(NUM_STEPS):
            timeline.step_units(
                step, gather, regather, reduce, units.prefetch, schedule.optimizer_fraction(world)
            )
        moved = _moved(network, world, plans, [units.phases] * len(plans))
        return self._result(world, setup, schedule, timeline, moved, [b.nbytes for b in plans])

    def _result(
        self,
        world: int,
        setup: ExchangeSetup,
        schedule: Any,
        timeline: _Timeline,
        moved: list[Any],
        bucket_bytes: list[int],
    ) -> StepResult:
        stats = timeline.stats[-1]
        return StepResult(
            world=world,
            trainers=schedule.num_trainers(world),
            setup=setup,
            schedule=schedule.describe(),
            step_s=stats["step_s"],
            compute_s=stats["compute_s"],
            exposed_s=stats["step_s"] - stats["compute_s"],
            exchange_wait_s=stats["exchange_wait_s"],
            parameter_wait_s=stats["parameter_wait_s"],
            optimizer_s=stats["optimizer_s"],
            batch_size=self.profile.batch_size,
            bytes_intra=sum(m.intra for m in moved),
            bytes_inter=sum(m.inter for m in moved),
            max_bytes_sent=sum(m.max_sent_by_rank for m in moved),
            bucket_bytes=bucket_bytes,
            events=timeline.events_of_last_step(),
        )

    def _run_fused(
        self, world: int, setup: ExchangeSetup, schedule: Any, network: Network
    ) -> StepResult:
        """Horovod's tensor fusion (``fusion_cycle_s``): buckets are formed while the step runs,
        so phase durations come from ``Network.interpolated`` over a grid of sizes."""
        total = self.profile.total_grad_bytes + FLAG_BYTES * len(self.profile.grad_sizes)
        probe = schedule.bucket_phases(world, network.codec, float(total))
        if schedule.return_phases(world) or any(p.gates != STEP for p in probe):
            raise ConfigError(
                f"exchange: fusion cycles model Horovod's allreduce; {schedule.describe()} "
                "updates at owners and needs phalanx's buckets"
            )
        cap = max(1, setup.bucket_bytes)
        for phase in probe:
            if phase.table is not None and (why := self._over_budget(phase, world, "message")):
                raise TooLarge(why)
        curves = {
            p.table.key: network.interpolated(p.table, world, min(total, cap) + 1)
            for p in probe
            if p.table is not None
        }
        moved: list[Any] = []
        recording = {"on": False}  # bytes are counted in the reported (last) step only
        optimizer_s_per_byte = self.at(world).optimizer_s_per_byte

        def exchange(nbytes: float) -> list[tuple[Phase, float]]:
            out = []
            for phase in schedule.bucket_phases(world, network.codec, nbytes):
                if phase.table is None:
                    update_s = optimizer_s_per_byte * phase.update_fraction * nbytes
                    out.append((phase, update_s))
                    continue
                if phase.table.key not in curves:
                    curves[phase.table.key] = network.interpolated(phase.table, world, cap + 1)
                out.append((phase, float(curves[phase.table.key](nbytes))))
                if recording["on"]:
                    moved.append(network.bytes(phase.table, world, nbytes))
            return out

        timeline = _Timeline(self.at(world), [], self._layer_of_grad)
        sizes: list[int] = []
        for step in range(NUM_STEPS):
            recording["on"] = step == NUM_STEPS - 1
            sizes = timeline.step_fused(
                step, exchange, cap, setup.fusion_cycle_s, schedule.optimizer_fraction(world)
            )
        return self._result(world, setup, schedule, timeline, moved, sizes)

    def _over_budget(self, phase: Phase, world: int, per: str) -> str | None:
        """Why simulating ``phase`` on ``world`` ranks would cost too much (None: it would not):
        its rounds per ``per`` over ``max_rounds``, or its largest round's messages over
        ``max_round_messages``."""
        table = phase.table
        assert table is not None
        if table.num_rounds > self.max_rounds:
            return (
                f"its {phase.name} on {world} ranks takes {table.num_rounds} rounds per {per}, "
                f"over the simulation's limit of {self.max_rounds}"
            )
        largest = int(np.diff(table.starts).max()) if table.num_rounds else 0
        if largest > self.max_round_messages:
            return (
                f"its {phase.name} on {world} ranks sends {largest} messages in one round, over "
                f"the simulation's limit of {self.max_round_messages}"
            )
        return None

    def _agree_s(self, network: Network, world: int) -> float:
        """Seconds of the non-finite guard's 1-element allreduce (``agreement_phases``)."""
        message = BucketPlan(index=0, grads=(), nbytes=4)
        return sum(self._durations(network, world, [message], [agreement_phases(world)])[0])

    def _durations(
        self, network: Network, world: int, buckets: list[BucketPlan], phases: list[list[Phase]]
    ) -> list[list[float]]:
        """Seconds of every phase of every bucket (one vectorised run per distinct table)."""
        by_table: dict[tuple, list[float]] = {}
        tables = {}
        for bucket, bucket_phases in zip(buckets, phases):
            for phase in bucket_phases:
                if phase.table is not None:
                    if why := self._over_budget(phase, world, "bucket"):
                        raise TooLarge(why)
                    by_table.setdefault(phase.table.key, []).append(bucket.nbytes * phase.scale)
                    tables[phase.table.key] = phase.table
        seconds = {
            key: dict(zip(sizes, network.seconds(tables[key], world, sizes)))
            for key, sizes in by_table.items()
        }
        optimizer = self.at(world).optimizer_s_per_byte
        return [
            [
                seconds[p.table.key][b.nbytes * p.scale]
                if p.table is not None
                else optimizer * p.update_fraction * b.nbytes
                for p in bucket_phases
            ]
            for b, bucket_phases in zip(buckets, phases)
        ]


def _moved(
    network: Network, world: int, buckets: list[BucketPlan], phases: list[list[Phase]]
) -> list[Any]:
    """The bytes each bucket's message phases move (``Network.bytes``), one entry a phase."""
    return [
        network.bytes(p.table, world, b.nbytes * p.scale)
        for b, bucket_phases in zip(buckets, phases)
        for p in bucket_phases
        if p.table is not None
    ]


def _progress(start: float, work: float, busy: list[tuple[float, float]], rate: float) -> float:
    """When ``work`` seconds of communication started at ``start`` end, running at ``rate`` of
    its speed inside the compute stream's ``busy`` intervals (sorted, disjoint) and at full
    speed outside them."""
    if rate >= 1.0:
        return start + work
    t = start
    for lo, hi in busy:
        if hi <= t:
            continue
        if lo > t:
            if t + work <= lo:
                return t + work
            work -= lo - t
            t = lo
        if work <= (hi - t) * rate:
            return t + work / rate
        work -= (hi - t) * rate
        t = hi
    return t + work


def _overlap(start: float, end: float, busy: list[tuple[float, float]]) -> float:
    """Seconds of [start, end] inside the compute stream's ``busy`` intervals."""
    return sum(max(0.0, min(end, hi) - max(start, lo)) for lo, hi in busy)


class _Timeline:
    """The compute and communication streams of consecutive steps (Phases 1-5, module doc)."""

    def __init__(
        self, profile: StepProfile, buckets: list[BucketPlan], layer_of_grad: list[int]
    ) -> None:
        self.profile = profile
        self.buckets = buckets
        self.layer_buckets: list[set[int]] = [set() for _ in profile.layers]
        self.last_layer: dict[int, list[int]] = {}  # layer -> buckets its backward completes
        for b in buckets:
            for g in b.grads:
                self.layer_buckets[layer_of_grad[g]].add(b.index)
            self.last_layer.setdefault(max(layer_of_grad[g] for g in b.grads), []).append(b.index)
        self.now = 0.0
        self.comm_free = 0.0
        self.params_ready = [0.0] * len(buckets)
        self.all_params_ready = 0.0  # return phases that gate the whole next step
        self.agree_s = 0.0  # the synchronisation between forward and backward, if any
        # hand-overs between the compute and the communication thread (ClusterConfig.handoff_s)
        self.handoff_s = 0.0
        self.on_thread = [False] * len(buckets)  # per bucket: its exchange is a thread's job
        self.returns_on_thread = False  # the send-back (return phases) too
        self.comm_rate = 1.0  # communication's speed while compute is busy (CPU ranks: < 1)
        # CPU ranks sharing cores: the compute thread runs at the same reduced rate while
        # communication runs beside it, so compute loses (1 - comm_rate) of every second they
        # overlap; ``stolen`` collects that until the compute stream is next advanced
        self.stolen = 0.0
        self.steals = True  # False: the profile's compute already holds it (the oracle)
        self.loss_s = 0.0  # the global loss's own all-reduce, beside backward (0: it rides)
        self.call_s = 0.0  # per unit collective, on the compute thread (collective_call_s)
        self.events: list[TraceEvent] = []
        self.stats: list[dict[str, float]] = []
        self.step_starts: list[float] = []

    def _event(
        self, lane: str, name: str, start: float, end: float, step: int, **args: Any
    ) -> None:
        if end > start:
            event = TraceEvent(lane=lane, name=name, start_s=start, duration_s=end - start)
            event.step, event.args = step, args
            self.events.append(event)

    def _phase_event(
        self, bucket: Any, phase: str, start: float, duration: float, step: int
    ) -> None:
        """One exchange phase of ``bucket`` on its track of the exchange lane."""
        self._event(
            LANE_EXCHANGE,
            f"b{bucket.index} {phase}",
            start,
            start + duration,
            step,
            bucket=bucket.index,
            bytes=bucket.nbytes,
        )

    def _steal(self, start: float, end: float, busy: list[tuple[float, float]]) -> None:
        """Communication over [start, end] beside compute on shared cores: compute runs at
        ``comm_rate`` too meanwhile, losing (1 - comm_rate) of the overlap."""
        if self.comm_rate < 1.0 and self.steals:
            self.stolen += _overlap(start, end, busy) * (1.0 - self.comm_rate)

    def _lose_stolen(self, step: int) -> None:
        """Advance the compute stream by what communication took from it (an event on the
        compute lane: the cores it shared)."""
        if self.stolen > 0:
            self._event(LANE_COMPUTE, "shared cores", self.now, self.now + self.stolen, step)
            self.now += self.stolen
            self.stolen = 0.0

    def step_fused(
        self, step: int, exchange: Any, cap: int, cycle_s: float, optimizer_fraction: float
    ) -> list[int]:
        """One step with Horovod's fusion: Phases 1, 2 and 4 as in ``step``; in Phase 3 the
        communication loop wakes at the first cycle tick after it is free and a gradient is
        ready, and sends every ready gradient (in order, up to ``cap`` bytes) as one message.
        Returns the sizes of the messages it sent."""
        start = self.now
        self.step_starts.append(start)
        parameter_wait = self._forward(step)
        backward_start = self.now
        grad_ready = []
        for layer in self.profile.layers:
            self.now += layer.backward_s
            grad_ready += [self.now] * len(layer.grad_bytes)
        self._event(LANE_COMPUTE, "backward", backward_start, self.now, step)
        sizes = [n + FLAG_BYTES for n in self.profile.grad_sizes]
        sent: list[int] = []
        step_done, i = self.now, 0
        while i < len(sizes):
            wake = max(self.comm_free, grad_ready[i], backward_start)
            ticks = math.ceil((wake - backward_start) / cycle_s - 1e-9)
            launch = backward_start + max(0, ticks) * cycle_s
            nbytes, first = 0, i
            while (
                i < len(sizes)
                and grad_ready[i] <= launch
                and (i == first or nbytes + sizes[i] <= cap)
            ):
                nbytes += sizes[i]
                i += 1
            clock = launch
            phases = exchange(nbytes)
            for _, duration in phases:
                clock += duration
            b = len(sent)
            self._event(
                LANE_EXCHANGE,
                f"b{b} exchange",
                launch,
                clock,
                step,
                bucket=b,
                bytes=nbytes,
                gradients=i - first,
                phases={p.name: d for p, d in phases},
            )
            sent.append(nbytes)
            self.comm_free = step_done = clock
        step_done = max(step_done, self.now)
        self._finish(step, start, step_done, optimizer_fraction, parameter_wait)
        return sent

    def _finish(
        self,
        step: int,
        start: float,
        step_done: float,
        optimizer_fraction: float,
        parameter_wait: float,
    ) -> None:
        """Phase 4 and the step's statistics (no send-back: fused exchanges have none)."""
        profile = self.profile
        exchange_wait = max(0.0, step_done - self.now)
        self._event(LANE_WAIT, "exchange", self.now, step_done, step)
        self.now = max(self.now, step_done)
        optimizer_s = profile.optimizer_s * optimizer_fraction
        self._event(LANE_OPTIMIZER, "optimizer", self.now, self.now + optimizer_s, step)
        self.now += optimizer_s
        compute = profile.compute_s - profile.optimizer_s + optimizer_s
        self.stats.append(
            {
                "step_s": self.now - start,
                "compute_s": compute,
                "exchange_wait_s": exchange_wait,
                "parameter_wait_s": parameter_wait,
                "optimizer_s": optimizer_s,
            }
        )

    def _forward(self, step: int) -> float:
        """Phase 1: input, then forward in the reverse of backward order; returns the time
        spent waiting for parameters."""
        layers = self.profile.layers
        parameter_wait = self._prologue(step)
        segment = self.now
        for index in reversed(range(len(layers))):
            need = max((self.params_ready[b] for b in self.layer_buckets[index]), default=0.0)
            if need > self.now:  # woken by the job that brought the parameters
                need += self.handoff_s if self._params_on_thread(index) else 0.0
                self._event(LANE_COMPUTE, "forward", segment, self.now, step)
                waited = sorted(self.layer_buckets[index])
                self._event(LANE_WAIT, "parameters", self.now, need, step, buckets=waited)
                parameter_wait += need - self.now
                self.now = segment = need
            self.now += layers[index].forward_s
        self._event(LANE_COMPUTE, "forward", segment, self.now, step)
        return parameter_wait

    def _prologue(self, step: int) -> float:
        """The step's start: input wait, the loop's own work, and a wait for return phases that
        gate the whole step; returns the time spent waiting for parameters."""
        profile = self.profile
        parameter_wait = 0.0
        self._lose_stolen(step)  # what the previous step's send-back took from this forward
        if profile.input_s > 0:
            self._event(LANE_INPUT, "input", self.now, self.now + profile.input_s, step)
            self.now += profile.input_s
        if profile.engine_s > 0:
            self._event(LANE_COMPUTE, "engine", self.now, self.now + profile.engine_s, step)
            self.now += profile.engine_s
        if self.all_params_ready > self.now:
            resume = self.all_params_ready + (self.handoff_s if self.returns_on_thread else 0.0)
            self._event(LANE_WAIT, "parameters", self.now, resume, step)
            parameter_wait += resume - self.now
            self.now = resume
        return parameter_wait

    def _params_on_thread(self, layer: int) -> bool:
        """Whether the parameters of ``layer`` come back as jobs of the communication thread
        (a send-back, or a pull inside the bucket's exchange)."""
        buckets = self.layer_buckets[layer]
        return self.returns_on_thread or any(self.on_thread[b] for b in buckets)

    def step(
        self,
        step: int,
        phases: list[list[Phase]],
        durations: list[list[float]],
        returns: list[Phase],
        return_durations: list[list[float]],
        optimizer_fraction: float,
    ) -> None:
        """One step with phalanx's buckets (Phases 1-5 of the module docstring)."""
        layers = self.profile.layers
        start = self.now
        self.step_starts.append(start)
        parameter_wait = self._forward(step)
        if self.agree_s > 0:  # every rank's loss is checked before any update can start
            self._event(LANE_WAIT, "agree", self.now, self.now + self.agree_s, step)
            self.now += self.agree_s
        # Phase 2: backward; buckets become ready as their last gradient does.
        ready = [0.0] * len(self.buckets)
        segment = backward_start = self.now
        for index, layer in enumerate(layers):
            self.now += layer.backward_s
            for b in self.last_layer.get(index, []):
                ready[b] = self.now
                self._event(LANE_COMPUTE, f"backward b{b}", segment, self.now, step, bucket=b)
                segment = self.now
        self._event(LANE_COMPUTE, "backward", segment, self.now, step)
        backward_end = self.now
        # Phase 3: the communication stream, bucket after bucket in launch order.
        launched, step_done = backward_start, backward_end
        next_ready = [0.0] * len(self.buckets)
        busy = [(backward_start, backward_end)]  # the compute stream, for comm_rate
        if self.loss_s > 0:  # on the backend's own thread, launched as backward starts
            self._steal(backward_start, _progress(backward_start, self.loss_s, busy,
                                                  self.comm_rate), busy)  # fmt: skip
        for bucket, bucket_phases, seconds in zip(self.buckets, phases, durations):
            b = bucket.index
            # backward so far lost ``stolen`` to communication: later gradients are later
            busy = [(backward_start, backward_end + self.stolen)]
            launched = max(launched, ready[b] + self.stolen, self.params_ready[b])
            clock = max(launched, self.comm_free)
            if self.on_thread[b] and self.comm_free < launched:  # the thread sleeps: wake it
                clock += self.handoff_s
            gate_end = clock
            for phase, duration in zip(bucket_phases, seconds):
                end = _progress(clock, duration, busy, self.comm_rate)
                self._steal(clock, end, busy)
                if phase.gates == FORWARD_PASS:
                    self._phase_event(bucket, phase.name, clock, end - clock, step)
                clock = end
                if phase.gates == STEP:
                    gate_end = clock
                else:
                    next_ready[b] = clock
            self._event(
                LANE_EXCHANGE,
                f"b{b} exchange",
                launched,
                gate_end,
                step,
                bucket=b,
                bytes=bucket.nbytes,
                queued_s=max(0.0, self.comm_free - launched),
                phases={p.name: d for p, d in zip(bucket_phases, seconds)},
            )
            self.comm_free = clock
            if self.on_thread[b] and gate_end > backward_end:  # the compute thread waits
                gate_end += self.handoff_s  # for the job, then wakes
            step_done = max(step_done, gate_end)
        # The compute that communication took from backward on shared cores: backward ends
        # that much later (the exchange's own slow-down is already in its phases).
        self._lose_stolen(step)
        step_done = max(step_done, self.now)
        # Phase 4: wait for the exchange, then the optimizer on this rank's share.
        self._finish(step, start, step_done, optimizer_fraction, parameter_wait)
        # Phase 5: send the updated buckets back, first those the next forward needs first;
        # the next step's own work and forward keep the compute stream busy meanwhile (its
        # waits for these very buckets are not known yet: left out).
        profile = self.profile
        ahead = profile.engine_s + profile.input_s + sum(layer.forward_s for layer in layers)
        busy = [(self.now, self.now + ahead)]
        for bucket in reversed(self.buckets):
            b = bucket.index
            clock = max(self.now, self.comm_free)
            if self.returns_on_thread and self.comm_free < self.now:  # the thread sleeps
                clock += self.handoff_s
            for phase, duration in zip(returns, return_durations[b]):
                end = _progress(clock, duration, busy, self.comm_rate)
                self._steal(clock, end, busy)  # taken from the next step's forward
                self._phase_event(bucket, phase.name, clock, end - clock, step)
                clock = end
                if phase.gates == STEP:
                    self.all_params_ready = max(self.all_params_ready, clock)
                else:
                    next_ready[b] = clock
            self.comm_free = clock
        self.params_ready = next_ready

    def step_units(
        self,
        step: int,
        gather: list[list[tuple[Phase, float]]],
        regather: list[list[tuple[Phase, float]]],
        reduce: list[list[tuple[Phase, float]]],
        prefetch: int,
        optimizer_fraction: float,
    ) -> None:
        """One step of a per-unit strategy (``self.buckets`` are the units; docs/planner.md,
        "Fully sharded"). Phases are (phase, seconds) per unit."""
        layers = self.profile.layers
        start = self.now
        self.step_starts.append(start)
        parameter_wait = self._prologue(step)
        forward = [(i, layers[i].forward_s) for i in reversed(range(len(layers)))]
        parameter_wait += self._unit_pass(step, "forward", forward, gather, prefetch, None)
        backward = [(i, layers[i].backward_s) for i in range(len(layers))]
        parameter_wait += self._unit_pass(step, "backward", backward, regather, prefetch, reduce)
        step_done = max(self.now, self.comm_free)  # the last reduce-scatter
        self._finish(step, start, step_done, optimizer_fraction, parameter_wait)

    def _unit_pass(
        self,
        step: int,
        label: str,
        order: list[tuple[int, float]],
        fetch: list[list[tuple[Phase, float]]],
        prefetch: int,
        after: list[list[tuple[Phase, float]]] | None,
    ) -> float:
        """One pass over (layer, compute seconds) in ``order``: before a unit's compute, its
        ``fetch`` and that of the next ``prefetch`` units are issued (torch's explicit
        prefetch), and the compute waits for its own; ``after`` is issued when its compute
        ends. Returns the time spent waiting for parameters."""
        unit_of = {i: min(units) for i, units in enumerate(self.layer_buckets) if units}
        queue = [unit_of[layer] for layer, _ in order if layer in unit_of]  # pass order
        ready: dict[int, float] = {}
        wait, remaining, position = 0.0, sum(s for _, s in order), 0
        segment = self.now
        for layer, compute_s in order:
            unit = unit_of.get(layer)
            if unit is not None:
                for ahead in queue[len(ready) : position + prefetch + 1]:
                    ready[ahead] = self._issue(step, ahead, fetch[ahead], remaining)
                position += 1
                if ready[unit] > self.now:
                    self._event(LANE_COMPUTE, label, segment, self.now, step)
                    self._event(LANE_WAIT, "parameters", self.now, ready[unit], step, unit=unit)
                    wait += ready[unit] - self.now
                    self.now = segment = ready[unit]
            self.now += compute_s + self.stolen  # the issued phases' share of the cores
            self.stolen = 0.0
            remaining -= compute_s
            if unit is not None and after is not None:
                self._issue(step, unit, after[unit], remaining)
        self._event(LANE_COMPUTE, label, segment, self.now, step)
        self._lose_stolen(step)  # the last reduce-scatter's share, beside the pass's end
        return wait

    def _issue(
        self, step: int, unit: int, phases: list[tuple[Phase, float]], remaining: float
    ) -> float:
        """Queue ``phases`` of ``unit`` on the communication stream now; returns when they
        end (0.0 when there is nothing to send: nothing to wait for). The compute stream is
        taken as busy for the ``remaining`` seconds of its pass (its later waits are not known
        yet), which slows the phases on CPU ranks (``comm_rate``)."""
        if not phases:
            return 0.0
        calls = self.call_s * len(phases)  # the compute thread's part of each collective
        if calls > 0:
            self._event(LANE_COMPUTE, "collective calls", self.now, self.now + calls, step)
            self.now += calls
        clock = max(self.now, self.comm_free)
        busy = [(self.now, self.now + remaining)]
        nbytes = self.buckets[unit].nbytes
        for phase, duration in phases:
            end = _progress(clock, duration, busy, self.comm_rate)
            self._steal(clock, end, busy)
            self._event(
                LANE_EXCHANGE,
                f"u{unit} {phase.name}",
                clock,
                end,
                step,
                bucket=unit,
                bytes=nbytes * phase.scale,
            )
            clock = end
        self.comm_free = clock
        return clock

    def events_of_last_step(self) -> list[TraceEvent]:
        """The last step's events, with the earlier step's that overlap it clipped to its start;
        times relative to its start."""
        origin = self.step_starts[-1]
        return [
            replace(
                e, start_s=max(e.start_s, origin) - origin, duration_s=end - max(e.start_s, origin)
            )
            for e in self.events
            if (end := e.start_s + e.duration_s) > origin
        ]


# -- the entry point for measured runs -----------------------------------------------------
def predict_step(
    backward: Any,
    link: Any,
    *,
    world_size: int,
    forward_s: float,
    batch_size: int,
    strategy: str = "allreduce",
    options: dict[str, Any] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    compress: str = "none",
    optimizer_s: float = 0.0,
    input_s: float = 0.0,
    codec_s_per_byte: float = 0.0,
    add_s_per_byte: float = 0.0,
) -> StepResult:
    """Predict one step of a run on ``world_size`` ranks of one node from what it measured: its
    ``BackwardProfile``, its ``LinkModel`` (or a link.json's path), forward, optimizer and input
    seconds. ``bucket_bytes``: the threshold the run used (after ``auto`` settled)."""

    cluster = from_link(
        link,
        devices_per_node=world_size,
        codec_s_per_byte=codec_s_per_byte,
        add_s_per_byte=add_s_per_byte,
    )
    profile = StepProfile.from_backward_profile(
        backward,
        forward_s=forward_s,
        batch_size=batch_size,
        optimizer_s=optimizer_s,
        input_s=input_s,
    )
    setup = ExchangeSetup(
        strategy=strategy,
        options=dict(options or {}),
        bucket_bytes=int(bucket_bytes),
        compress=compress,
    )
    return Simulator(profile, cluster, measured_beside_exchange=True).run(world_size, setup)
