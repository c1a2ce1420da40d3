"""``phalanx plan``: the planner's predicted step time and speed-up at N devices, from a
config, a cluster and a measured (or given) step profile."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from phalanx.config import load_config
from phalanx.errors import ConfigError
from phalanx.exchange.messages import WIRE_CODECS
from phalanx.fileio import atomic_write_text
from phalanx.planner.calibrate import load_or_calibrate, slowdown_now
from phalanx.planner.exchanges import SCHEDULES
from phalanx.planner.plan import (
    AUTO,
    DEFAULT_COMPRESSIONS,
    DEFAULT_DEVICES,
    DEFAULT_THRESHOLDS,
    _parse_mib,
    compare_with_trace,
    default_strategies,
    format_plan,
    make_plan,
    plot_plan,
    read_cluster,
    recommendation,
    write_traces,
)
from phalanx.planner.step import load_step_profile, measure_step_profile


def add_parser(commands: argparse._SubParsersAction) -> None:
    """``phalanx plan`` and its flags."""
    p = commands.add_parser("plan", help="predict step time and speed-up at N devices")
    p.add_argument("config", help="the run's TOML config (model, batch, exchange options)")
    p.add_argument(
        "--cluster",
        metavar="FILE",
        help="cluster TOML (configs/clusters/), a cached calibration, or the link.json of "
        "phalanx bench link (default: this machine, calibrated once and cached per host)",
    )
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="measure this machine again (without --cluster) and replace its cached calibration",
    )
    p.add_argument(
        "--devices",
        metavar="N,N,...",
        help="device counts; '...' continues a doubling: 1,2,4,...,1024 (default "
        "1,2,4,...,1024, as far as the cluster has devices)",
    )
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="step profile JSON (plan's own, phalanx profile --json, or a backward "
        "profile); default: measure the config's model here",
    )
    p.add_argument(
        "--strategies",
        metavar="A,B",
        help="strategies to plan (default: every one the planner models)",
    )
    p.add_argument(
        "--thresholds",
        default=",".join(DEFAULT_THRESHOLDS),
        metavar="MIB,auto",
        help="fusion thresholds in MiB, or auto (default 25,auto)",
    )
    p.add_argument(
        "--compress",
        default=",".join(DEFAULT_COMPRESSIONS),
        metavar="none,fp16",
        help="compressions (default none,fp16)",
    )
    p.add_argument(
        "--steps",
        type=int,
        help="steps to measure without --profile, the first a warm-up (default: until the "
        "steps' times are stable, as phalanx profile)",
    )
    p.add_argument("--device", default="auto", help="where to measure: auto, cpu or cuda[:N]")
    p.add_argument(
        "--all", action="store_true", help="every threshold and compression (default: each "
        "strategy's best)",
    )  # fmt: skip
    p.add_argument("--json", metavar="FILE", help="write every number here")
    p.add_argument("--plot", metavar="PNG", help="speed-up against N (viz extra)")
    p.add_argument("--trace", metavar="DIR", help="a Chrome trace per N of the best setup")
    p.add_argument(
        "--compare",
        metavar="TRACE",
        help="a measured trace (phalanx train --trace DIR: DIR/trace.json): its step per lane "
        "next to the config's setup simulated at the trace's number of ranks",
    )
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="tracebacks")
    p.set_defaults(handler=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.set)
    if args.cluster and args.recalibrate:
        raise ConfigError("--recalibrate: measures this machine; drop it or --cluster")
    asked = None if args.devices is None else _parse_devices(args.devices)  # before measuring
    if args.cluster:
        cluster = read_cluster(args.cluster)
    else:
        calibration = load_or_calibrate(args.recalibrate)
        print(calibration.describe())
        cluster = calibration.cluster
    if asked is None:
        devices = [n for n in DEFAULT_DEVICES if cluster.capacity is None or n <= cluster.capacity]
    else:
        devices = asked
    for n in devices:
        cluster.check_devices(n)
    strategies = _strategies(args.strategies, config.exchange)
    compressions = _names(args.compress, "--compress")

    for name in compressions:
        if name not in WIRE_CODECS:
            raise ConfigError(f"--compress: unknown {name!r}; known: {', '.join(WIRE_CODECS)}")
    thresholds = _names(args.thresholds, "--thresholds")
    for t in thresholds:
        if t != AUTO:
            _parse_mib(t)
    if args.plot:
        from phalanx.memory.profile import require_matplotlib

        require_matplotlib()  # fail before the work, not after it
    if args.profile:
        profile = load_step_profile(args.profile)
    else:
        names = [name for name, _ in strategies]
        profile = measure_step_profile(config, args.steps, args.device, strategies=names)
    if not args.cluster:  # this host: its compute slow-down moves with its load, probe it now
        cluster = slowdown_now(cluster)
    plan = make_plan(profile, cluster, devices, strategies, thresholds, compressions)
    print(format_plan(plan, every=args.all))
    print(recommendation(plan, max(devices), args.config, args.set))
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(plan.to_dict(), indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot_plan(plan, Path(args.plot))
        print(f"wrote {args.plot}")
    if args.trace:
        paths = write_traces(plan, Path(args.trace))
        print(f"wrote {len(paths)} trace(s) to {args.trace}")
    if args.compare:
        print(compare_with_trace(plan, Path(args.compare), config.exchange))
    return 0


def _names(text: str, flag: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise ConfigError(f"{flag}: give at least one value")
    return list(dict.fromkeys(names))


def _parse_devices(text: str) -> list[int]:
    """Counts, where '...' between a, b and c doubles on from b up to c (1,2,...,16)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    try:
        devices: list[int] = []
        for i, name in enumerate(names):
            if name == "...":
                devices += _doubling(devices, int(names[i + 1]), text)
            else:
                devices.append(int(name))
    except (ValueError, IndexError):
        raise ConfigError(
            f"--devices: expected counts like 1,2,4,8 or 1,2,4,...,1024, got {text!r}"
        ) from None
    if not devices or min(devices) < 1:
        raise ConfigError(f"--devices: counts must be >= 1, got {text!r}")
    return sorted(set(devices))


def _doubling(before: list[int], last: int, text: str) -> list[int]:
    """The counts '...' stands for: doubling from the count before it, below ``last``."""
    if not before or before[-1] < 1:
        raise ConfigError(f"--devices: '...' needs a count before it, as in 1,2,...,16: {text!r}")
    counts, n = [], 2 * before[-1]
    while n < last:
        counts.append(n)
        n *= 2
    return counts


def _strategies(text: str | None, exchange: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, options) per strategy; the config's strategy keeps the config's options."""

    names = default_strategies() if text is None else _names(text, "--strategies")
    for name in names:
        if name not in SCHEDULES:
            raise ConfigError(
                f"--strategies: unknown {name!r}; known: {', '.join(SCHEDULES.names())}"
            )
    return [(n, dict(exchange.options) if n == exchange.strategy else {}) for n in names]
