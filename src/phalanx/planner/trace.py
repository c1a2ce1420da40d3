"""Chrome trace JSON of training steps (Perfetto and chrome://tracing read it), and a reader: one
format, microseconds, ``pid`` the rank, ``cat`` the lane (``LANES``), for simulated steps
(``phalanx plan --trace``) and measured ones, so both are summed the same way. Slices on one
track must nest, so a lane has one track per bucket where needed, named by a ``thread_name``
event. Lanes and slices: docs/planner.md, "Traces"."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.errors import DataError
from phalanx.fileio import atomic_write_text

LANE_COMPUTE = "compute"
LANE_EXCHANGE = "exchange"
LANE_WAIT = "wait"
LANE_OPTIMIZER = "optimizer"
LANE_INPUT = "input"
LANES = (LANE_COMPUTE, LANE_EXCHANGE, LANE_WAIT, LANE_OPTIMIZER, LANE_INPUT)
_TRACK_BASE = {LANE_COMPUTE: 0, LANE_WAIT: 1, LANE_OPTIMIZER: 2, LANE_INPUT: 3}
_BUCKET_TRACKS = 10  # tids from here: exchange of bucket k is track 10 + k
US = 1e6


@dataclass(kw_only=True)
class TraceEvent:
    """One slice: ``lane`` (one of LANES), a name, start and duration in seconds, its rank and
    step, and arguments (``bucket`` puts it on that bucket's track of the lane)."""

    lane: str
    name: str
    start_s: float
    duration_s: float
    rank: int = 0
    step: int = 0
    args: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))  # the fields in order: lane, name, ..., args


def track_of(event: TraceEvent) -> tuple[int, str]:
    """(tid, track name) of an event: one track per lane, per bucket for the exchange lane."""
    bucket = event.args.get("bucket")
    if event.lane == LANE_EXCHANGE and bucket is not None:
        return _BUCKET_TRACKS + int(bucket), f"{LANE_EXCHANGE} b{int(bucket)}"
    if event.lane not in _TRACK_BASE:
        raise ValueError(f"trace: unknown lane {event.lane!r}; lanes: {', '.join(LANES)}")
    return _TRACK_BASE[event.lane], event.lane


def chrome_trace(events: Iterable[TraceEvent], **metadata: Any) -> dict[str, Any]:
    """The Chrome trace object of ``events`` (``metadata`` goes to ``otherData``)."""
    out: list[dict[str, Any]] = []
    named: set[tuple[int, int]] = set()
    for event in events:
        tid, track = track_of(event)
        if (event.rank, tid) not in named:
            named.add((event.rank, tid))
            out.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": event.rank,
                    "tid": tid,
                    "args": {"name": track},
                }
            )
            out.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": event.rank,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
        out.append(
            {
                "name": event.name,
                "cat": event.lane,
                "ph": "X",
                "ts": event.start_s * US,
                "dur": event.duration_s * US,
                "pid": event.rank,
                "tid": tid,
                "args": {"step": event.step, **event.args},
            }
        )
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": metadata}


def write_trace(path: Path | str, events: Iterable[TraceEvent], **metadata: Any) -> Path:
    """Write ``events`` as a Chrome trace JSON file, atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(chrome_trace(events, **metadata)) + "\n")
    return path


def read_trace(path: Path | str) -> list[dict[str, Any]]:
    """The complete ("X") events of a Chrome trace file, each with its ``lane`` added (from
    ``cat``, else from the first word of its track's ``thread_name``)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: cannot read a trace ({err})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise DataError(f"{path}: not a Chrome trace (no traceEvents list)")
    names = {
        (e.get("pid"), e.get("tid")): str(e.get("args", {}).get("name", ""))
        for e in events
        if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    out = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        lane = e.get("cat") or names.get((e.get("pid"), e.get("tid")), "").split(" ")[0]
        out.append({**e, "lane": lane})
    return out


def lane_totals(
    events: Iterable[dict[str, Any]], rank: int | None = None, step: int | None = None
) -> dict[str, float]:
    """Seconds per lane summed over ``events`` (from ``read_trace``), for one rank and one
    step if given (``step`` is read from each event's ``args``)."""
    totals = dict.fromkeys(LANES, 0.0)
    for e in events:
        if rank is not None and e.get("pid") != rank:
            continue
        if step is not None and e.get("args", {}).get("step") != step:
            continue
        lane = e["lane"]
        totals[lane] = totals.get(lane, 0.0) + float(e.get("dur", 0.0)) / US
    return totals
