"""Phase 2 of the Engine's step with ``[parallel] pipeline > 1``, as a component: torch's
schedule runs each accumulation step's micro-batches through the stages, the buckets launch
during the last backward, and the non-finite guard's verdict reaches every stage.

Phases, as the Engine calls them:
  Phase 2 (``forward_backward``): the schedule over the micro-batches; before each backward
    (``before_backward``, called by the pipeline) the buckets are armed, launching only in the
    last one when the stage's backward passes come in order; a bad loss on the last stage
    poisons its buckets, so its verdict travels with the exchange; strategies that update while
    gradients arrive agree on the loss first, in one all-reduce over the world.
  Phase 4 (``combine_over_stages``): each stage's verdict and norm summed over this replica's
    stages, the whole model's.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from phalanx.engine.guard import NonfiniteGuard
from phalanx.engine.slot import StrategySlot
from phalanx.exchange.buckets import GradientBuckets
from phalanx.faults import fault_at
from phalanx.parallel.pipeline import PipelineParallel
from phalanx.precision import Precision
from phalanx.runtime.context import Context


class PipelineDriver:
    def __init__(
        self,
        pipeline: PipelineParallel,
        buckets: GradientBuckets,
        slot: StrategySlot,
        guard: NonfiniteGuard,
        precision: Precision,
        world: Context,
    ) -> None:
        self.pipeline, self.buckets, self.slot = pipeline, buckets, slot
        self.guard, self.precision, self.world = guard, precision, world
        self._launch = False  # this accumulation step's last backward launches
        self._bad_so_far = False  # the last stage's loss was inf/NaN this step
        self._fault_nan = False  # an injected fault makes this step's loss NaN

    # Phase 2
    def run(
        self, inputs: list[Any], scale: float, step: int, trace: Any
    ) -> tuple[torch.Tensor, bool]:
        """``forward_backward``, traced as one span of ``trace`` (the Engine's StepTrace)."""
        started = time.perf_counter()
        result = self.forward_backward(inputs, scale, step)
        trace.span("compute", "pipeline schedule", started)
        return result

    def forward_backward(
        self, inputs: list[Any], scale: float, step: int
    ) -> tuple[torch.Tensor, bool]:
        """``inputs``: the micro-batches (inputs, targets); ``scale``: the loss's factor;
        ``step``: the step's number (1-based, for fault points). Returns (mean loss, skip):
        the loss is this replica's (0-dim, on the device) on the rank with the last stage and
        0 elsewhere."""
        pipeline = self.pipeline
        total_loss = torch.zeros((), device=self.world.device)
        pipeline.reset_counts()
        self._fault_nan = pipeline.holds_last and fault_at("forward", step) == "nan"
        self._bad_so_far = False
        for i, (x, y) in enumerate(inputs):
            self._launch = i == len(inputs) - 1 and self._overlaps
            with self.precision.autocast():
                loss = pipeline.step(x, y, scale, listener=self)
            total_loss += loss / len(inputs)
            self._bad_so_far = self._loss_bad_now()
        if self._fault_nan:
            total_loss = total_loss * float("nan")
        if pipeline.holds_last and self.guard.nonfinite is not None:
            self.buckets.poison = self._bad_so_far  # for buckets flushed after this
        return total_loss, self._verdict_before_exchange(total_loss)

    def before_backward(self, last_backward: bool) -> None:  # the pipeline's listener
        launch = last_backward and self._launch
        if launch and self.guard.nonfinite is not None:  # every forward of this stage is done
            self.buckets.poison = self._loss_bad_now()
        self.buckets.arm(launch=launch)

    def grads_written(self, params: list[torch.nn.Parameter]) -> None:
        self.buckets.written(params)

    def _loss_bad_now(self) -> bool:
        """On the last stage's rank: whether any micro-batch loss of this step so far (or an
        injected fault) is inf/NaN."""
        if not self.pipeline.holds_last:
            return False
        return self._bad_so_far or self._fault_nan or not self.pipeline.losses_finite()

    @property
    def _overlaps(self) -> bool:
        """Buckets launch inside the schedule's last backward when one set of buckets sees one
        stage's backward passes in order, and no agreement must come first."""
        agree_first = self.slot.current.updates_during_exchange and self.guard.nonfinite is not None
        return len(self.pipeline.stage_ids) == 1 and not agree_first

    def _verdict_before_exchange(self, loss: torch.Tensor) -> bool:
        """Strategies that update while gradients arrive agree on the loss's health before
        anything is exchanged: one flag all-reduced over the world (the last stages know)."""
        if self.guard.nonfinite is None or not self.slot.current.updates_during_exchange:
            return False
        flag = torch.tensor([float(not bool(torch.isfinite(loss)))], device=self.world.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.world.group)
        return bool(flag.item() > 0)

    # Phase 4
    def combine_over_stages(self, bad: bool, norm: float | None) -> tuple[bool, float | None]:
        """Each stage's verdict and norm cover its own parameters (a bad loss poisoned the
        last stage's exchange, and the exchange made each stage's verdict its replicas'):
        summing them over this replica's stages gives the whole model's, the same on every
        rank, with no message between replicas."""
        squares = 0.0 if norm is None else norm * norm
        value = torch.tensor([float(bad), squares], dtype=torch.float64, device=self.world.device)
        value = self.pipeline.sum_over_stages(value)
        return bool(value[0].item() > 0), None if norm is None else float(value[1].item()) ** 0.5
