"""``phalanx plan``: the predicted step, throughput and speed-up at N devices for every setup
(strategy x threshold x compression), from the simulator (docs/planner.md, "Reading a plan").

Phases of ``make_plan``:
  Phase 1: the setups; a per-unit strategy (``fsdp``) has no threshold, refused compressions noted.
  Phase 2: per N, per setup, the simulation; setups it cannot afford or run are listed as skipped.
  Phase 3: the best setup per N."""

from __future__ import annotations

import json
import math
import shlex
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from phalanx.errors import ConfigError
from phalanx.exchange.buckets import FIRST_BUCKET_BYTES
from phalanx.exchange.link import LinkModel
from phalanx.exchange.messages import make_wire_codec
from phalanx.exchange.threshold import choose_bucket_bytes
from phalanx.planner import calibrate
from phalanx.planner.cluster import (
    ClusterConfig,
    from_link,
    load_cluster,
    measure_add_s_per_byte,
    measure_codec_s_per_byte,
)
from phalanx.planner.exchanges import SCHEDULES, make_schedule
from phalanx.planner.sim import (
    DEFAULT_BUCKET_BYTES,
    MAX_ROUNDS,
    ExchangeSetup,
    Simulator,
    StepResult,
)
from phalanx.planner.step import StepProfile
from phalanx.planner.trace import chrome_trace, lane_totals, read_trace, write_trace

MIB = 2**20
AUTO = "auto"
DEFAULT_DEVICES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_THRESHOLDS = ("25", AUTO)
DEFAULT_COMPRESSIONS = ("none", "fp16")


def default_strategies() -> list[str]:
    """The phalanx exchange strategies the planner has a schedule for (registry order): every
    schedule but the models of other systems (``Schedule.models_strategy``)."""

    return [name for name in SCHEDULES.names() if make_schedule(name).models_strategy]


@dataclass(kw_only=True)
class PlanRow:
    """One setup at one N: its simulated step, or why it was skipped."""

    devices: int
    setup: ExchangeSetup
    result: StepResult | None = None
    skipped: str = ""
    speedup: float = 0.0
    efficiency: float = 0.0
    above_linear: str = ""  # why efficiency is over 100% (the one-device step does more)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "devices": self.devices,
            "strategy": self.setup.strategy,
            "options": self.setup.options,
            "threshold": self.setup.threshold_label,
            "bucket_bytes": self.setup.bucket_bytes,
            "first_bucket_bytes": self.setup.first_bucket_bytes,
            "compress": self.setup.compress,
        }
        if self.result is None:
            return {**out, "skipped": self.skipped}
        return {
            **out,
            **self.result.to_dict(),
            "speedup": self.speedup,
            "efficiency": self.efficiency,
            **({"above_linear": self.above_linear} if self.above_linear else {}),
        }


@dataclass(kw_only=True)
class Plan:
    """Every row of a plan, and what it was made from."""

    cluster: ClusterConfig
    profile: StepProfile
    devices: list[int]
    rows: list[PlanRow] = field(default_factory=list)
    # "strategy / compression (why)" for the cells a strategy cannot run (fsdp with fp16)
    not_applicable: list[str] = field(default_factory=list)

    @property
    def single_device_s(self) -> float:
        return self.profile.scaled(self.cluster.compute_speed).compute_s

    def best(self, devices: int, *, choice: bool = False) -> PlanRow | None:
        """The row with the most samples/s at ``devices`` (None if every setup was skipped);
        ``choice``: among the rows at most 100% efficient (above that the model predicts what
        the one-device step cannot show, so such a row is never recommended)."""
        done = [r for r in self.rows if r.devices == devices and r.result is not None]
        if choice:
            done = [r for r in done if not r.above_linear]
        return max(done, key=lambda r: r.result.samples_per_s) if done else None  # type: ignore[union-attr]

    def to_dict(self) -> dict[str, Any]:
        best = {
            str(n): (b.to_dict() if (b := self.best(n, choice=True)) else None)
            for n in self.devices
        }
        return {
            "cluster": self.cluster.to_dict(),
            "profile": {
                "source": self.profile.source,
                "batch_size": self.profile.batch_size,
                "layers": len(self.profile.layers),
                "gradient_bytes": self.profile.total_grad_bytes,
                "forward_s": self.profile.forward_s,
                "backward_s": self.profile.backward_s,
                "optimizer_s": self.profile.optimizer_s,
                "input_s": self.profile.input_s,
                "timed_steps": self.profile.meta.get("timed_steps"),
                "step_spread": self.profile.spread,
                "single_device_step_s": self.single_device_s,
            },
            "devices": self.devices,
            "not_applicable": self.not_applicable,
            "rows": [r.to_dict() for r in self.rows],
            "best": best,
        }


def make_plan(
    profile: StepProfile,
    cluster: ClusterConfig,
    devices: list[int],
    strategies: list[tuple[str, dict[str, Any]]],
    thresholds: tuple[str, ...] | list[str] = DEFAULT_THRESHOLDS,
    compressions: tuple[str, ...] | list[str] = DEFAULT_COMPRESSIONS,
    max_rounds: int | None = None,
) -> Plan:
    """Simulate every setup at every device count (Phases 1-3 above)."""
    for n in devices:
        cluster.check_devices(n)
    simulator = Simulator(profile, cluster, max_rounds=max_rounds or MAX_ROUNDS)
    plan = Plan(cluster=cluster, profile=profile, devices=list(devices))
    single = plan.single_device_s
    specs, plan.not_applicable = _specs(strategies, thresholds, compressions)
    for n in devices:
        simulator.prefetch(n, [s for spec in specs for s in _setups(simulator, n, *spec)])
        for spec in specs:  # Phases 1 and 2
            row = _row(simulator, n, *spec)
            if row.result is not None:
                row.speedup = row.result.samples_per_s * single / profile.batch_size
                row.efficiency = row.speedup / n
                row.above_linear = above_linear(row, profile)
            plan.rows.append(row)
    return plan


def threshold_of(exchange: Any) -> str:
    """The plan's threshold label for a config's ``[exchange] bucket_mb``: MiB, or ``auto``."""
    return AUTO if exchange.bucket_mb == AUTO else f"{exchange.bucket_mb:g}"


def recommended_sets(row: PlanRow) -> list[str]:
    """The ``--set`` items that run ``row``'s setup (``phalanx train --set ...``): its strategy,
    options, fusion threshold (none for per-unit strategies) and compression."""
    setup = row.setup
    sets = [f"exchange.strategy={setup.strategy}", f"exchange.compress={setup.compress}"]
    if setup.options:
        items = ", ".join(f"{k} = {json.dumps(v)}" for k, v in sorted(setup.options.items()))
        sets.append(f"exchange.options={{ {items} }}")
    if setup.threshold_label.startswith(AUTO):
        sets.append(f"exchange.bucket_mb={AUTO}")
    elif not make_schedule(setup.strategy, setup.options).unit_label:  # buckets to size
        sets.append(f"exchange.bucket_mb={setup.bucket_bytes / 2**20:g}")
    return sets


def recommendation(
    plan: Plan, devices: int, config: str = "CONFIG", sets: Sequence[str] = ()
) -> str:
    """One line: the fastest setup at ``devices`` and the command that runs it, ready to paste
    (``config``: the run config's path; ``sets``: the plan's own ``--set`` overrides, which
    the recommended ones follow)."""
    best = plan.best(devices, choice=True)
    if best is None or best.result is None:
        return f"recommendation at {devices}: none (every setup was skipped)"
    given = "".join(f" --set {shlex.quote(item)}" for item in sets)
    run = f"phalanx train {shlex.quote(config)} --nproc {devices}{given}"
    flags = " ".join(f"--set {shlex.quote(item)}" for item in recommended_sets(best))
    return (
        f"recommendation at {devices}: {best.setup.label()}, predicted "
        f"{best.result.step_s * 1e3:.1f} ms per step: {run} {flags} (or {run} --auto-plan)"
    )


def above_linear(row: PlanRow, profile: StepProfile | None = None) -> str:
    """Why a row's efficiency is over 100% ('' when it is not): fewer parameters updated per
    rank, updates during backward, or its own Engine's one-process step measured faster than
    the config's; anything else is a bug of the model, and says so."""
    if round(row.efficiency * 100) <= 100:
        return ""
    schedule = make_schedule(row.setup.strategy, row.setup.options)
    share = schedule.optimizer_fraction(row.devices)
    if share == 0.0 and schedule.num_trainers(row.devices) < row.devices:
        return "dedicated servers run the optimizer: the trainers have none to run"
    if share == 0.0:
        return (
            "the servers update each bucket on the communication thread while backward goes "
            "on, which the one-device step does after backward"
        )
    if share < 1.0:
        return (
            f"each rank's optimizer updates 1/{round(1 / share)} of the parameters, where the "
            "one-device step updates them all"
        )
    if profile is not None and row.setup.strategy in profile.strategy_phases:
        own, baseline = profile.for_strategy(row.setup.strategy).compute_s, profile.compute_s
        if own < baseline:
            return (
                f"its Engine's one-process step measured {own * 1e3:.1f} ms against the "
                f"config's {baseline * 1e3:.1f} ms; on one process the strategies differ only "
                "in bookkeeping, so that is mostly this machine's measurement spread: profile "
                "again on a quiet machine"
            )
    return "not explained by the model: a bug, please report it with this plan's --json"


def _specs(
    strategies: list[tuple[str, dict[str, Any]]],
    thresholds: Sequence[str],
    compressions: Sequence[str],
) -> tuple[list[tuple[str, dict, str, str]], list[str]]:
    """(strategy, options, threshold, compression) per cell of the table, and the cells left
    out because the strategy cannot run that compression. A strategy that exchanges per unit
    (``Schedule.unit_label``) has one threshold: its units."""
    specs, refused = [], []
    for name, options in strategies:
        schedule = make_schedule(name, options)
        layouts = [schedule.unit_label] if schedule.unit_label else list(thresholds)
        for compress in compressions:
            if why := schedule.refuses(make_wire_codec(compress)):
                refused.append(f"{name} / {compress} ({why})")
                continue
            specs += [(name, options, layout, compress) for layout in layouts]
    return specs, refused


def _setups(
    simulator: Simulator, n: int, name: str, options: dict, threshold: str, compress: str
) -> list[ExchangeSetup]:
    """The setups one threshold spec stands for (``auto``: the autotuner's candidates; a
    per-unit strategy's label: its units, no threshold)."""
    if threshold == make_schedule(name, options).unit_label:
        layouts = [(threshold, DEFAULT_BUCKET_BYTES, FIRST_BUCKET_BYTES)]
    else:
        layouts = _thresholds(simulator, n, threshold)
    return [
        ExchangeSetup(
            strategy=name,
            options=dict(options),
            bucket_bytes=bucket_bytes,
            first_bucket_bytes=first,
            compress=compress,
            threshold_label=label,
        )
        for label, bucket_bytes, first in layouts
    ]


def _row(
    simulator: Simulator, n: int, name: str, options: dict, threshold: str, compress: str
) -> PlanRow:
    """One setup at n devices; ``auto`` tries the autotuner's candidates and keeps the best."""
    best: PlanRow | None = None
    for setup in _setups(simulator, n, name, options, threshold, compress):
        try:
            result = simulator.run(n, setup)
        except ConfigError as e:  # over the budget, or not runnable at n (ps servers >= n)
            return PlanRow(devices=n, setup=setup, skipped=str(e))
        if best is None or result.step_s < best.result.step_s:  # type: ignore[union-attr]
            best = PlanRow(devices=n, setup=setup, result=result)
    assert best is not None
    return best


def _thresholds(simulator: Simulator, n: int, threshold: str) -> list[tuple[str, int, int]]:
    """(label, bucket bytes, first bucket bytes) to simulate for one threshold spec."""

    if threshold != AUTO:
        size = _parse_mib(threshold)
        return [(f"{threshold} MiB", size, FIRST_BUCKET_BYTES)]

    profile = simulator.profile
    total = profile.total_grad_bytes
    if n == 1:
        return [(f"auto ({total / MIB:.3g} MiB)", total + 1, total + 1)]
    alpha, beta = simulator.cluster.ring_link(n)
    link = LinkModel(alpha_s=alpha, beta_bytes_per_s=beta, world_size=n)
    choice = choose_bucket_bytes(profile.layers, link, n).bucket_bytes
    layouts = [
        (choice, FIRST_BUCKET_BYTES),
        (DEFAULT_BUCKET_BYTES, FIRST_BUCKET_BYTES),
        (total + 1, total + 1),
    ]
    return [(f"auto ({b / MIB:.3g} MiB)", b, f) for b, f in dict.fromkeys(layouts)]


def _parse_mib(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--thresholds: {text!r} is not a size in MiB or 'auto'") from None
    if not value > 0 or math.isinf(value):
        raise ConfigError(f"--thresholds: sizes must be > 0 MiB, got {text!r}")
    return int(value * MIB)


# -- output -----------------------------------------------------------------------------------
def format_plan(plan: Plan, every: bool = False) -> str:
    """The table per N (one row per strategy, or ``every`` combination; the best within 100%
    marked), each note once, and a summary of the best per N."""
    p, c = plan.profile, plan.cluster
    lines = [
        f"phalanx plan | cluster {c.name} ({c.devices_per_node} devices/node, intra "
        f"{_link(c.intra)}" + (f", inter {_link(c.inter)}" if c.inter else "") + ")",
        f"step profile: {p.source or 'given'}; batch {p.batch_size}/device, {len(p.layers)} "
        f"layers, gradients {p.total_grad_bytes / MIB:.1f} MiB, one device "
        f"{plan.single_device_s * 1e3:.1f} ms/step (forward {p.forward_s * 1e3:.1f}, backward "
        f"{p.backward_s * 1e3:.1f}, optimizer {p.optimizer_s * 1e3:.1f}"
        + (f", input {p.input_s * 1e3:.2f}" if p.input_s else "")
        + ")",
    ]
    lines += [f"assumed (not measured): {term}" for term in c.assumed]
    lines += _spread_lines(p)
    lines += [f"not planned: {why}" for why in plan.not_applicable]
    header = ("N", "strategy", "threshold", "compress", "step ms", "exposed ms", "samples/s",
              "speed-up", "eff", "")  # fmt: skip
    for n in plan.devices:
        best = plan.best(n, choice=True)
        rows = [header] + [_cells(row, row is best) for row in _shown(plan, n, every)]
        lines.append("")
        lines += _table(rows)
    lines += _notes(plan)
    lines.append("")
    lines.append("best per N (at most 100% efficient):")
    summary = [("N", "setup", "samples/s", "speed-up", "efficiency")]
    for n in plan.devices:
        best = plan.best(n, choice=True)
        if best is None:
            summary.append((str(n), "none within 100% (see the notes)", "", "", ""))
            continue
        summary.append(
            (
                str(n),
                best.setup.label(),
                f"{best.result.samples_per_s:.1f}",  # type: ignore[union-attr]
                f"{best.speedup:.2f}x",
                f"{best.efficiency:.0%}",
            )
        )
    lines += _table(summary)
    return "\n".join(lines)


def _shown(plan: Plan, n: int, every: bool) -> list[PlanRow]:
    """The rows of N's table: by default one per strategy (its fastest threshold and
    compression, within 100% where one is); ``every``: each combination, but a row that
    predicts exactly what an earlier one of its strategy does (compression and threshold
    cannot matter at N = 1) is not repeated."""
    groups: dict[str, list[PlanRow]] = {}
    for row in (r for r in plan.rows if r.devices == n):
        groups.setdefault(_name(row.setup), []).append(row)
    shown = []
    for rows in groups.values():
        done = [r for r in rows if r.result is not None]
        if not done:
            shown.append(rows[0])  # skipped: one row says why
            continue
        if not every:
            within = [r for r in done if not r.above_linear] or done
            shown.append(max(within, key=lambda r: r.result.samples_per_s))  # type: ignore[union-attr]
            continue
        seen: set[tuple[float, float]] = set()
        for row in rows:
            key = (0.0, 0.0) if row.result is None else (row.result.step_s, row.result.exposed_s)
            if row.result is None or key not in seen:
                shown.append(row)
            seen.add(key)
    return shown


def _name(setup: ExchangeSetup) -> str:
    return setup.strategy + (f"({_options(setup.options)})" if setup.options else "")


def _cells(row: PlanRow, best: bool) -> tuple[str, ...]:
    s = row.setup
    first = (str(row.devices), _name(s), s.threshold_label, s.compress)
    if row.result is None:
        return (*first, "skipped", "", "", "", "", row.skipped)
    r = row.result
    mark = "<- best" if best else "over 100%: see the notes" if row.above_linear else ""
    times = (f"{r.step_s * 1e3:.1f}", f"{r.exposed_s * 1e3:.1f}", f"{r.samples_per_s:.1f}")
    return (*first, *times, f"{row.speedup:.2f}x", f"{row.efficiency:.0%}", mark)


def _notes(plan: Plan) -> list[str]:
    """Each reason an efficiency is over 100% once, with the rows it explains."""
    by_reason: dict[str, list[PlanRow]] = {}
    for row in plan.rows:
        if row.above_linear:
            by_reason.setdefault(row.above_linear, []).append(row)
    lines = []
    for reason, rows in by_reason.items():
        first = rows[0]
        more = f", and {len(rows) - 1} more row(s)" if len(rows) > 1 else ""
        lines.append(
            f"over 100%: {first.setup.label()} at {first.devices} ({first.efficiency:.0%})"
            f"{more}: {reason}"
        )
    return [""] + lines if lines else []


def _spread_lines(profile: StepProfile) -> list[str]:
    """How stable the profile's median is, and a warning when it is not (memory/profile.py)."""
    from phalanx.memory.profile import SPREAD_WARNING

    spread = profile.spread
    if spread is None:
        return []
    steps = profile.meta.get("timed_steps", "?")
    lines = [f"profile spread: the {steps} timed steps' IQR is {spread:.1%} of their median"]
    if spread > SPREAD_WARNING:
        lines.append(
            f"warning: the profile's spread is {spread:.0%} (> {SPREAD_WARNING:.0%}): every "
            "prediction below is as uncertain; profile again on a quiet machine"
        )
    return lines


def _link(link: Any) -> str:
    return f"{link.alpha_s * 1e6:.1f} us + n / {link.beta_bytes_per_s / 1e9:.2f} GB/s"


def _options(options: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(options.items()))


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    last = len(widths) - 1  # free text (a note): never widens the other columns
    widths[last] = 0
    return [
        "  "
        + "  ".join(
            cell.ljust(w) if i < 4 or i == last else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in rows
    ]


def plot_plan(plan: Plan, output: Path) -> None:
    """A PNG of the speed-up against N (log2 axis): per strategy its best setup, and ideal."""
    from phalanx.memory.profile import require_matplotlib

    pyplot = require_matplotlib()
    fig, ax = pyplot.subplots(figsize=(8, 5))
    ax.plot(plan.devices, plan.devices, color="grey", linestyle="--", label="linear")
    for name in dict.fromkeys(r.setup.strategy for r in plan.rows):
        points = []
        for n in plan.devices:
            done = [
                r
                for r in plan.rows
                if r.devices == n and r.setup.strategy == name and r.result is not None
            ]
            if done:
                points.append((n, max(r.speedup for r in done)))
        if points:
            ax.plot(*zip(*points), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(plan.devices, [str(n) for n in plan.devices])
    ax.set_xlabel("devices")
    ax.set_ylabel("speed-up over one device")
    ax.set_title(
        f"predicted speed-up on {plan.cluster.name}\n(per strategy: its best threshold and "
        "compression)",
        fontsize=10,
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    pyplot.close(fig)


def write_traces(plan: Plan, directory: Path) -> list[Path]:
    """One Chrome trace per N: the simulated step of the best setup."""

    paths = []
    for n in plan.devices:
        best = plan.best(n)
        if best is None or best.result is None:
            continue
        paths.append(
            write_trace(
                directory / f"plan-n{n}.json",
                best.result.events,
                source="phalanx plan (simulated)",
                devices=n,
                setup=best.setup.label(),
                step_s=best.result.step_s,
                cluster=plan.cluster.name,
            )
        )
    return paths


def compare_with_trace(plan: Plan, path: Path, exchange: Any) -> str:
    """Seconds per lane of a measured step (rank 0, median over the traced steps) next to
    the simulated step of the config's own setup (strategy, threshold, compression) at the
    trace's number of ranks, which the plan must include."""

    measured = read_trace(path)
    world = len({e["pid"] for e in measured})
    label = "auto" if exchange.bucket_mb == AUTO else f"{float(exchange.bucket_mb):g} MiB"
    if exchange.strategy in SCHEDULES:  # else: no row, said below
        label = make_schedule(exchange.strategy, exchange.options).unit_label or label
    rows = [
        r
        for r in plan.rows
        if r.devices == world
        and r.result is not None
        and r.setup.strategy == exchange.strategy
        and r.setup.compress == exchange.compress
        and r.setup.threshold_label.startswith(label.split(" ")[0])
    ]
    if not rows:
        raise ConfigError(
            f"--compare: the plan has no {exchange.strategy} / {label} / {exchange.compress} "
            f"row at {world} devices (the trace's ranks); add {world} to --devices"
        )
    row = min(rows, key=lambda r: r.result.step_s if r.result else float("inf"))
    assert row.result is not None
    simulated = [
        {**e, "lane": e["cat"]}
        for e in chrome_trace(row.result.events)["traceEvents"]
        if e.get("ph") == "X"
    ]
    last = max(e["args"]["step"] for e in simulated)
    steps = sorted({e["args"]["step"] for e in measured if e["pid"] == 0})
    per_step = [lane_totals(measured, rank=0, step=s) for s in steps]
    predicted = lane_totals(simulated, rank=0, step=last)
    lines = [
        f"measured ({path}, rank 0, median of {len(steps)} steps) vs simulated "
        f"({row.setup.label()}, {world} devices), ms per step:",
        f"  {'lane':<10} {'measured':>9} {'simulated':>10}",
    ]
    for lane in predicted:
        value = statistics.median(t[lane] for t in per_step) if per_step else 0.0
        lines.append(f"  {lane:<10} {1e3 * value:>9.2f} {1e3 * predicted[lane]:>10.2f}")
    return "\n".join(lines)


def read_cluster(path: str) -> ClusterConfig:
    """A cluster TOML, a cached calibration (calibrate.py's JSON), or the link.json of
    ``phalanx bench link`` on this machine: its codec's and add's cost per byte are then
    measured here, its cores are this process's (what the link.json does not hold)."""
    if Path(path).suffix == ".json" and _json_format(path) == calibrate.FORMAT:
        return calibrate.load_calibration(Path(path)).cluster
    if Path(path).suffix == ".json" or Path(path).is_dir():
        cluster = from_link(
            path,
            codec_s_per_byte=measure_codec_s_per_byte(),
            add_s_per_byte=measure_add_s_per_byte(),
            host_cores=calibrate.host_cores(),
        )
        return replace(
            cluster, description=f"{cluster.description}; codec, add and cores measured here"
        )
    return load_cluster(path)


def _json_format(path: str) -> object:
    """The ``format`` of a JSON object file (None: none, or not readable: the caller's
    reader then says what is wrong)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data.get("format") if isinstance(data, dict) else None
