"""The bucket layout's step hooks (phalanx.engine.hooks): the observed order after the first step,
and ``bucket_mb = "auto"`` (F12): measure the link, profile the first backward passes, choose the
fusion threshold from the cost model (phalanx.exchange.threshold), then time the candidate
layouts and keep the fastest (phalanx.exchange.autotune).

Phases of AutoBucketing, as the Engine calls them:
  Phase 0 (construction): calibrate the link (collective: every rank at once); record each
    bucket's ready time from then on. The link that cannot be measured (optional: every rank
    fits rank 0's timings, so all fail alike) keeps the default layout, with a warning line.
  Phase 2 (``before_backward`` / ``after_backward``, around each backward): the recorder
    profiles the step's last backward.
  Phase 5 (``end`` of a step whose update was applied, the same step on every rank): after
    the profiled steps, agree on rank 0's profile, choose, and rebuild the buckets; then one
    timed step per candidate layout, and the fastest is kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from phalanx.engine.hooks import StepEnd, StepHook
from phalanx.exchange.autotune import LayoutTrials
from phalanx.exchange.buckets import GradientBuckets, plan_buckets
from phalanx.exchange.comm import global_rank
from phalanx.exchange.link import LinkModel, calibrate
from phalanx.exchange.threshold import BackwardRecorder, Choice, agree_profile, choose_bucket_bytes
from phalanx.optional import optional
from phalanx.runtime.context import Context

logger = logging.getLogger("phalanx")

DEFAULT_BUCKET_MB = 25.0  # the layout until "auto" has measured enough to choose
PROFILE_STEPS = 3  # backward steps profiled (after one warm-up step) before choosing

# (order of the parameters, bucket bytes, first bucket bytes): the Engine's rebuild
Rebuild = Callable[[list[int], int, int | None], None]


class ObservedOrder(StepHook):
    """After this Engine's first update, re-order the buckets by the observed backward order
    (rank 0's); a resumed Engine too, whose update count does not start at 0.

    Every rank takes part in the broadcast whatever it observed, so ranks that saw different
    unused parameters still agree on one layout."""

    def __init__(
        self, ctx: Context, buckets: GradientBuckets, num_params: int, rebuild: Rebuild
    ) -> None:
        self.ctx, self.buckets, self.num_params, self._rebuild = ctx, buckets, num_params, rebuild
        self.observed = False

    # Phase 5
    def end(self, step: StepEnd) -> None:
        if not step.updated or self.observed:
            return
        self.observed = True
        seen = self.buckets.ready_order
        seen_set = set(seen)
        missing = [i for i in reversed(range(self.num_params)) if i not in seen_set]
        order = torch.tensor(seen + missing, dtype=torch.int64, device=self.ctx.device)
        dist.broadcast(order, global_rank(self.ctx.group, 0), group=self.ctx.group)
        observed = order.tolist()
        if observed != list(reversed(range(self.num_params))):
            self._rebuild(observed, self.buckets.bucket_bytes, None)


class AutoBucketing(StepHook):
    """``buckets``: the Engine's (their ready times are recorded); ``trainable``: the
    parameters they hold, in the Engine's order; ``rebuild``: how the Engine changes layout
    (parameters and optimizer state carried over)."""

    def __init__(
        self,
        ctx: Context,
        buckets: GradientBuckets,
        trainable: Sequence[torch.Tensor],
        rebuild: Rebuild,
    ) -> None:
        self.ctx, self.buckets, self.trainable, self._rebuild = ctx, buckets, trainable, rebuild
        # Phase 0
        self.link: LinkModel | None = optional(
            lambda: calibrate(ctx.group, ctx.device),
            None,
            what='bucket_mb = "auto": the link not measured',
            instead=f"{DEFAULT_BUCKET_MB:g} MiB buckets kept",
            again="run again on a less loaded machine, or set exchange.bucket_mb to a size",
        )
        self.threshold: Choice | None = None  # the cost model's choice, once made
        self.trials_text = ""  # what the timed layouts measured, once decided
        self._recorder: BackwardRecorder | None = None
        self._trials: LayoutTrials | None = None
        if self.link is not None:
            self._recorder = BackwardRecorder(num_steps=PROFILE_STEPS, skip_steps=1)
            buckets.on_ready = self._recorder.record

    @property
    def done(self) -> bool:
        return self._recorder is None and self._trials is None

    # Phase 2
    def before_backward(self, last: bool) -> None:
        if self._recorder is not None and last:
            self._recorder.start()

    def after_backward(self) -> None:
        if self._recorder is not None:
            self._recorder.stop()

    # Phase 5
    def end(self, step: StepEnd) -> None:
        if step.updated:  # every rank skips alike: the schedule counts updates only
            self._finish_trials(step.stats.step_s)
            self._choose(step.num_updates)

    def _choose(self, num_updates: int) -> None:
        """Once the profiled steps are done (the same step on every rank): agree on rank 0's
        backward profile, choose the threshold and rebuild the buckets."""
        recorder, link = self._recorder, self.link
        if recorder is None or num_updates + 1 != recorder.skip_steps + recorder.num_steps:
            return
        assert link is not None  # a recorder only where the link was measured
        mine = recorder.profile() if recorder.done else None  # None on dedicated servers
        profile = agree_profile(mine, self.ctx.group, self.ctx.device)
        first = self.buckets.first_bucket_bytes
        self.threshold = choose_bucket_bytes(
            profile.layer_costs(), link, self.ctx.world_size, first_bucket_bytes=first
        )
        logger.info("phalanx: %s", self.threshold.describe())
        self._recorder = None
        self.buckets.on_ready = None
        total = profile.total_bytes
        candidates = [(self.threshold.bucket_bytes, first)]
        candidates += [(int(DEFAULT_BUCKET_MB * 2**20), first), (total + 1, total + 1)]
        self._trials = LayoutTrials(self._distinct_layouts(candidates))
        self._rebuild(self.buckets.order(), *candidates[0])

    def _distinct_layouts(self, candidates: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Candidates whose bucket layouts differ (same layout: same speed, try once)."""
        ordered = [self.trainable[i] for i in self.buckets.order()]
        seen, out = set(), []
        for bucket_bytes, first in candidates:
            layout = tuple(map(tuple, plan_buckets(ordered, bucket_bytes, first)))
            if layout not in seen:
                seen.add(layout)
                out.append((bucket_bytes, first))
        return out

    def _finish_trials(self, step_s: float) -> None:
        """After the model's choice: time each candidate layout, keep the fastest."""
        trials = self._trials
        if trials is None or not trials.record(step_s):
            return
        following = trials.advance()
        if following is not None:
            self._rebuild(
                self.buckets.order(), following.bucket_bytes, following.first_bucket_bytes
            )
            return
        chosen = trials.decide(self.ctx.group, self.ctx.device)
        self.trials_text = trials.describe(chosen)
        logger.info("phalanx: %s", self.trials_text)
        self._trials = None
        self._rebuild(self.buckets.order(), chosen.bucket_bytes, chosen.first_bucket_bytes)
