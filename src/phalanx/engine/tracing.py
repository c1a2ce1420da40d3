"""Chrome traces of real training steps (issue 13, deliverable 1), from the Engine's own clocks.

``Engine(..., trace=TraceConfig(directory="traces"))`` (or ``phalanx train ... --trace DIR``)
records ``num_steps`` steps from ``first_step`` on every rank and writes one Perfetto-readable
file, ``DIR/trace.json`` (rank 0 gathers every rank's events; ``pid`` is the rank), in the format
of the planner's simulated traces (``phalanx.planner.trace``: the same lanes), so a measured
step and a predicted one open side by side. Lanes:

  - ``compute``: each micro-batch's forward; backward per bucket, "backward b3" running from the
    previous bucket's last gradient (or backward's start) to bucket 3's last gradient;
  - ``exchange``: each bucket from its launch to its completion (the backend's or the
    communication thread's completion callback: the profiler cannot see that thread);
  - ``wait``: the step waiting for the exchange after backward ("exchange"), and forward
    waiting for parameters still arriving ("parameters b3", owner-update strategies; these
    slices lie inside forward's);
  - ``optimizer``: the update;
  - ``input``: the wait for the input pipeline's next batch (the Trainer reports it).

Timestamps are wall-clock microseconds (``time.time`` at the step's start plus
``perf_counter`` offsets), so ranks on one machine line up exactly and across machines as well
as their clocks agree. On CUDA the Engine synchronizes the device at each mark of a traced step
(a traced step runs slower; untraced steps are untouched).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.engine.hooks import StepEnd, StepHook
from phalanx.fields import option, require
from phalanx.optional import optional
from phalanx.planner.trace import TraceEvent, write_trace

TRACE_FILE = "trace.json"


@dataclass(kw_only=True)
class TraceConfig:
    """Which steps to trace and where the Chrome trace goes."""

    directory: str = option("", "where trace.json is written ('' = no trace)")
    first_step: int = option(2, "first traced step (1-based; step 1 warms up and rebuilds buckets)")
    num_steps: int = option(3, "consecutive steps traced")

    def __post_init__(self) -> None:
        require(self.first_step >= 1, "first_step", f"must be >= 1, got {self.first_step}")
        require(self.num_steps >= 1, "num_steps", f"must be >= 1, got {self.num_steps}")

    @property
    def enabled(self) -> bool:
        return bool(self.directory)


class StepTracer:
    """Collects one rank's events of the traced steps; ``finish_step`` writes the file after
    the last one (a collective over the Engine's group: every rank reaches the same step)."""

    def __init__(self, config: TraceConfig, rank: int, device: torch.device) -> None:
        self._event = TraceEvent
        self.config = config
        self.rank = rank
        self.cuda = device.type == "cuda"
        self.events: list[Any] = []
        self.step = 0  # the step being traced (1-based), 0 when not tracing
        self._wall0 = 0.0
        self._perf0 = 0.0
        self.written: Path | None = None

    def begin(self, step: int) -> bool:
        """At a step's start: whether this step is traced."""
        first = self.config.first_step
        self.step = step if first <= step < first + self.config.num_steps else 0
        if self.step:
            self._sync()
            self._wall0, self._perf0 = time.time(), time.perf_counter()
        return bool(self.step)

    def now(self) -> float:
        """A perf_counter timestamp, after the device's queued work (CUDA) when tracing."""
        if self.step:
            self._sync()
        return time.perf_counter()

    def span(self, lane: str, name: str, start: float, end: float, **args: Any) -> None:
        """Record [start, end] (perf_counter seconds) on ``lane`` for the traced step."""
        if not self.step or end < start:
            return
        wall = self._wall0 + (start - self._perf0)
        self.events.append(
            self._event(
                lane=lane,
                name=name,
                start_s=wall,
                duration_s=end - start,
                rank=self.rank,
                step=self.step,
                args=args,
            )
        )

    def buckets(self, buckets: list[Any], backward_start: float, exchange_end: float) -> None:
        """Backward per bucket and each bucket's exchange, from the buckets' timestamps."""
        previous = backward_start
        for b in sorted(buckets, key=lambda b: b.ready_time or float("inf")):
            ready = b.ready_time or previous
            self.span("compute", f"backward b{b.index}", previous, ready, bucket=b.index)
            previous = max(previous, ready)
        for b in buckets:
            if b.launched:
                done = b.done_time if b.done_time >= b.launch_time else exchange_end
                self.span(
                    "exchange",
                    f"b{b.index} exchange",
                    b.launch_time,
                    done,
                    bucket=b.index,
                    bytes=b.nbytes,
                )

    def finish_step(self, group: Any, meta: dict[str, Any]) -> Path | None:
        """After a traced step: on the last one, gather every rank's events to rank 0, which
        writes ``directory/trace.json``; returns its path there (None elsewhere)."""
        last = self.config.first_step + self.config.num_steps - 1
        if self.step != last:
            return None
        self.step = 0
        gathered: list[Any] = [None] * dist.get_world_size(group) if dist.is_initialized() else []
        if gathered:
            dist.all_gather_object(gathered, self.events, group=group)
        else:
            gathered = [self.events]
        self.events = []
        if self.rank != 0:
            return None

        events = [e for rank_events in gathered for e in rank_events]
        path = Path(self.config.directory) / TRACE_FILE
        self.written = optional(  # the trace is optional: the run goes on without it
            lambda: write_trace(path, events, source="measured", **meta),
            None,
            what=f"trace not written to {path}",
            instead="the run goes on without it",
            again="pass a writable --trace DIR (or [trace] directory) next time",
        )
        return self.written

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class StepTrace(StepHook):
    """The Engine's traces as a step hook: the spans of a traced step's phases, then the
    strategy's (parameter waits, the communication thread's work) at its end.

    ``tracer``: None when not tracing (settable: a bench may trace an Engine it built);
    ``slot`` (the current strategy) and ``buckets``: the Engine's; ``world``: the Context of
    every process, over whose group the last traced step gathers every rank's events."""

    def __init__(self, tracer: StepTracer | None, slot: Any, buckets: Any, world: Any) -> None:
        self.tracer, self.slot, self.buckets, self.world = tracer, slot, buckets, world
        self.tracing = False  # whether the current step is traced
        self.backward_started = 0.0  # perf_counter at the last backward's start
        self._exchange_waited = 0.0  # perf_counter when Phase 4 started waiting

    def span(self, lane: str, name: str, start: float, **args: Any) -> float:
        """Record [start, now] on ``lane`` when this step is traced; returns now."""
        if not self.tracing:
            return time.perf_counter()
        assert self.tracer is not None
        end = self.tracer.now()
        self.tracer.span(lane, name, start, end, **args)
        return end

    def input(self, start: float, end: float) -> None:
        """The wait for the next batch, before the step that follows."""
        if self.tracer is not None and self.tracer.step:
            self.tracer.span("input", "next batch", start, end)

    # Phase 1
    def begin(self, step: int) -> None:
        self.tracing = self.tracer is not None and self.tracer.begin(step)

    # Phase 4
    def after_exchange(self) -> None:
        if self.tracing:
            assert self.tracer is not None
            end = self.span("wait", "exchange", self._exchange_waited)
            self.tracer.buckets(self.buckets.buckets, self.backward_started, end)

    def waiting_for_exchange(self) -> None:
        """Phase 4 starts: the step waits for the exchange from now."""
        self._exchange_waited = time.perf_counter()

    # Phase 5
    def end(self, step: StepEnd) -> None:
        spans = self.slot.current.take_thread_spans()  # taken every step: the list stays short
        if not self.tracing:
            return
        assert self.tracer is not None
        for b, start, end in self.slot.current.param_waits:  # inside forward's span
            self.tracer.span("wait", f"parameters b{b}", start, end, bucket=b)
        for lane, name, b, nbytes, start, end in spans:  # the communication thread's work
            self.tracer.span(lane, name, start, end, bucket=b, bytes=nbytes)
        self.tracer.finish_step(self.world.group, self._meta())
        self.tracing = False

    def _meta(self) -> dict[str, Any]:
        return {
            "strategy": type(self.slot.current).__name__,
            "world_size": self.world.world_size,
            "bucket_bytes": [b.nbytes for b in self.buckets.buckets],
            "compress": self.slot.current.codec.name,
            "device": str(self.world.device),
        }
