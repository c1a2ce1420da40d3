"""Engine: one synchronous data-parallel training step with exchange overlapped with backward."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from phalanx import checkpoint
from phalanx.batches import Batch, loss_of, split_batch, step_batch
from phalanx.errors import CheckpointError, ConfigError
from phalanx.exchange.auto_bucketing import DEFAULT_BUCKET_MB, AutoBucketing
from phalanx.exchange.base import Strategy, make_strategy
from phalanx.exchange.buckets import FIRST_BUCKET_BYTES, GradientBuckets
from phalanx.exchange.comm import global_rank
from phalanx.exchange.compression import make_codec
from phalanx.exchange.link import LinkModel
from phalanx.exchange.threshold import Choice
from phalanx.faults import fault_at
from phalanx.global_loss import GlobalLoss
from phalanx.guard import NonfiniteGuard
from phalanx.memory.manager import MemoryManager
from phalanx.memory.residency import OptimizerResidency
from phalanx.metrics import PhaseTimer, StepStats
from phalanx.optim.user import OptimizerSpec, group_of, resolve_optimizer
from phalanx.parallel.driver import PipelineDriver
from phalanx.parallel.layout import ParallelConfig
from phalanx.parallel.pipeline import PipelineParallel, build_pipeline
from phalanx.precision import Precision
from phalanx.runtime.context import (
    Context,
    current_context,
    hold_until_shutdown,
    on_shutdown,
    unregister_shutdown,
)
from phalanx.tracing import StepTracer, TraceConfig

logger = logging.getLogger("phalanx")
AUTO = "auto"
NONFINITE = ("skip", "abort", None)
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


class Engine:
    """Wraps a model, a loss and an optimizer factory; ``step`` trains on one batch.

    Phases of ``step(inputs, targets)`` (inputs: (B, ...) on any device; targets: (B, ...)):
      Phase 1: zero the gradient buckets; split the batch into ``accumulate_steps`` micro-batches.
      Phase 2: forward + backward per micro-batch (the loss scaled by the strategy's 1/p, so
        exchanged sums are means); on the last one, backward hooks hand each full bucket to
        the exchange strategy while backward continues (overlap, F8).
      Phase 3: launch the buckets unused parameters held back (zeros in their place).
      Phase 4: wait for the exchange (the exposed part is ``stats.exchange_s``); parameters no
        rank used (per the buckets' summed usage flags) keep ``grad = None``.
      Phase 5: update (the strategy applies the optimizer).
    Parameters and buffers are broadcast from rank 0 at construction so all replicas start equal.

    With ``parallel`` (pipeline > 1, phalanx.parallel) Phase 2 is torch's pipeline schedule over
    this rank's stages and the Engine's world is the mesh's data sub-group; with ``memory`` (a
    MemoryManager, phalanx.memory) Phase 2 runs inside its offload/recompute plan.

    Lifecycle: ``close()`` is optional. The Engine registers its teardown with the Context at
    construction, so ``phalanx.shutdown()`` and interpreter exit wait for pending send-backs
    and stop the communication thread before the process group is destroyed. ``with
    Engine(...) as engine:`` closes at the end of the block.

    Reads of the model see the updated parameters: ``engine.module``, ``state_dict()`` of the
    module or any submodule (a state-dict pre-hook waits for that submodule's parameters) and
    every forward (a forward pre-hook does the same). With owner-update strategies
    (``partitioned``, ``ps``) the updated parameters travel back in the background after
    ``step`` returns, overlapping the next forward (F8/F19); only code that reads
    ``param.data`` directly (``model.parameters()``, a kept reference to a weight) must call
    ``engine.sync()`` first.

    ``engine.optimizer`` is the same object for the whole run: bucket rebuilds (after step 1,
    and while ``bucket_mb = "auto"`` chooses) re-point it at the new layout and move its
    state, so an LR scheduler attached to it keeps acting.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: LossFn | None = None,
        optimizer: OptimizerSpec | None = None,
        *,
        exchange: str | Strategy = "allreduce",
        bucket_mb: float | str = 25.0,
        compress: str | None = None,
        accumulate_steps: int = 1,
        first_bucket_mb: float | None = None,
        broadcast_buffers: bool = True,
        nonfinite: str | None = "skip",
        max_nonfinite: int = 10,
        max_grad_norm: float | None = None,
        precision: str = "fp32",
        context: Context | None = None,
        parallel: ParallelConfig | None = None,
        stages: list[int] | None = None,
        sample_input: Any = None,
        memory: MemoryManager | None = None,
        trace: TraceConfig | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model: pass a torch.nn.Module; got {type(model).__name__}")
        if optimizer is None:
            raise ConfigError(
                "optimizer: required; pass the optimizer built over model.parameters() or a "
                "factory params -> Optimizer"
            )
        if loss_fn is not None and not callable(loss_fn):
            raise ConfigError(
                f"loss_fn: pass a function (output, targets) -> loss, or None when the model "
                f"returns its own loss; got {type(loss_fn).__name__}"
            )
        if bucket_mb != AUTO and (isinstance(bucket_mb, str) or not bucket_mb > 0):
            raise ConfigError(f"bucket_mb: got {bucket_mb!r}; allowed: a size > 0 (MiB) or 'auto'")
        if accumulate_steps < 1:
            raise ConfigError(f"accumulate_steps: must be >= 1, got {accumulate_steps}")
        if nonfinite not in NONFINITE:
            raise ConfigError(f"nonfinite: got {nonfinite!r}; allowed: 'skip', 'abort' or None")
        if max_nonfinite < 0:
            raise ConfigError(f"max_nonfinite: must be >= 0, got {max_nonfinite}")
        _check_kinds(
            max_grad_norm=(max_grad_norm, (int, float), "a number > 0 or None"),
            memory=(memory, MemoryManager, "a phalanx.memory.manager.MemoryManager or None"),
            trace=(trace, TraceConfig, "a phalanx.tracing.TraceConfig or None"),
            parallel=(parallel, ParallelConfig, "a phalanx.parallel.layout.ParallelConfig or None"),
            context=(context, Context, "the Context of phalanx.init() or None"),
        )
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm: must be > 0 or None, got {max_grad_norm}")
        self.ctx = context or current_context()
        self.world = self.ctx  # every process; self.ctx becomes the data-parallel group
        self.tracer: StepTracer | None = None  # Chrome traces of a few steps (phalanx.tracing)
        self._backward_started = 0.0  # perf_counter at the last backward's start (traces)
        if trace is not None and trace.enabled:
            self.tracer = StepTracer(trace, self.ctx.rank, self.ctx.device)
        self.pipeline: PipelineParallel | None = None
        if parallel is not None and parallel.enabled:
            if bucket_mb == AUTO:
                raise ConfigError(
                    "bucket_mb: 'auto' profiles one whole backward pass, which a pipeline "
                    "splits over ranks; give a size in MiB with pipeline > 1"
                )
            if loss_fn is None:
                raise ConfigError(
                    "loss_fn: pipeline > 1 computes the loss on the last stage from loss_fn; "
                    "give one (the model's own loss works with pipeline = 1)"
                )
            self.pipeline = build_pipeline(model, loss_fn, parallel, self.ctx, sample_input, stages)
            model, self.ctx = self.pipeline.local, self.pipeline.data_context
        if memory is not None and self.pipeline is not None:
            raise ConfigError(
                "memory: the memory manager works on one stage per model copy; "
                "use it with pipeline = 1"
            )
        self.memory = memory
        self._module = model.to(self.ctx.device)
        self.loss_fn = loss_fn
        self.accumulate_steps = accumulate_steps
        self.broadcast_buffers = broadcast_buffers and any(True for _ in model.buffers())
        self.strategy = make_strategy(exchange)
        self.precision = Precision(precision, self.ctx.device)
        self.guard = NonfiniteGuard(nonfinite, max_nonfinite, max_grad_norm, self.precision)
        self._check_rescaling(max_grad_norm)
        self.strategy.codec = make_codec(compress)  # ConfigError listing the allowed values
        self.stats = StepStats()
        self.num_steps = 0  # steps run (what fault points and guard messages count, 0-based)
        self.num_updates = 0  # steps whose update was applied (the auto layout's schedule)
        self._broadcast_state()
        self.trainable = [p for p in self._module.parameters() if p.requires_grad]
        self.buckets = GradientBuckets(
            self.trainable,
            int((DEFAULT_BUCKET_MB if bucket_mb == AUTO else float(bucket_mb)) * 2**20),
            launch=self.strategy.launch,
            align=self.strategy.bucket_alignment(self.ctx.world_size),
            first_bucket_bytes=int((first_bucket_mb or FIRST_BUCKET_BYTES / 2**20) * 2**20),
        )
        self._driver: PipelineDriver | None = None  # Phase 2 with pipeline > 1 (a component)
        if self.pipeline is not None:
            parts = (self.buckets, self.strategy, self.guard, self.precision, self.world)
            self._driver = PipelineDriver(self.pipeline, *parts)
        # The user's optimizer over the model's parameters (instance or factory), checked;
        # sharded strategies cut their shards where its parameter groups change.
        shards = self.strategy.optimizer_follows_layout
        name = exchange if isinstance(exchange, str) else type(exchange).__name__
        user_optimizer = resolve_optimizer(optimizer, self.trainable, strategy=name, shards=shards)
        self.strategy.group_of = group_of(user_optimizer) if shards else None
        self.strategy.setup(self.ctx, self.buckets.buckets)
        if self.pipeline is not None and self.strategy.data_parallel()[1] != self.ctx.world_size:
            raise ConfigError(
                "exchange.strategy: dedicated parameter servers train no stage; with pipeline "
                "> 1 every rank must train (ps with servers = 0)"
            )
        self.optimizer = self.strategy.adopt_optimizer(user_optimizer, self.trainable)
        # [memory] optimizer: the state in the memory tier between steps (stream), or the
        # masters, state and arithmetic on the host (mirror; layers wait in forward pre-hooks).
        self._mirror: OptimizerResidency | None = (
            None if memory is None else memory.attach_optimizer(self.optimizer, self._module)
        )
        if self._mirror is not None:  # gradients to the host as each bucket's exchange ends
            self._mirror.listen(self.strategy)
        self.strategy.register_module(self._module)
        # Closing must not depend on this object: a script's ranks may drop their Engine (return
        # from main) while an exchange is still pending. The teardown owns the parts and runs
        # at shutdown, or as soon as the Engine is collected on the thread that built it.
        self._teardown = _Teardown(self.strategy, self.buckets, self.pipeline, self.memory)
        self._unregister_teardown = on_shutdown(self._teardown)
        weakref.finalize(self, self._teardown.on_collected).atexit = False
        # bucket_mb = "auto" (F12): measure the link now, profile backward in the first steps,
        # then choose the threshold and time the candidate layouts (a component).
        self.auto: AutoBucketing | None = None
        if bucket_mb == AUTO:
            self.auto = AutoBucketing(self.ctx, self.buckets, self.trainable, self._rebuild)
        self._timer = PhaseTimer(self.ctx.device)
        # The step's mean loss over every rank (engine.stats.loss): a component.
        self.global_loss = GlobalLoss(self.world, keep=self._teardown.hold)

    def _check_rescaling(self, max_grad_norm: float | None) -> None:
        problem = rescaling_problem(
            self.strategy.updates_during_exchange,
            type(self.strategy).__name__,
            max_grad_norm=max_grad_norm,
            precision=self.precision.name,
            nonfinite=self.guard.nonfinite,
        )
        if problem is not None:
            raise ConfigError(f"{problem[0]}: {problem[1]}")

    # -- the step -----------------------------------------------------------------------------
    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Train on one batch; returns this rank's mean loss (a detached 0-dim tensor).

        With a ``loss_fn``: ``step(inputs, targets)`` computes ``loss_fn(model(inputs),
        targets)``. Without one, the arguments go to the model as they are
        (``step(idx, targets)``, ``step(**batch)``) and the model's output is the loss: a
        0-dim tensor, an object or dict with a ``loss`` (Hugging Face), or a tuple holding one
        0-dim tensor (``(logits, loss)``)."""
        if self._closed:
            raise ConfigError(
                "step: this Engine is closed (by close(), phalanx.shutdown() or the end of its "
                "with block); build a new Engine to train again"
            )
        timer = self._timer
        timer.start()
        tracing = self.tracer is not None and self.tracer.begin(self.num_steps + 1)
        self._module.train()
        # Phase 1: zero buckets; split into micro-batches.
        self.buckets.zero()
        self.strategy.begin_step()
        if self._mirror is not None:
            self._mirror.begin_step()
        micro = []
        if self.strategy.is_trainer:  # a dedicated server has no batch, only its exchange part
            micro = self._split(self._batch(args, kwargs))
        total_loss = torch.zeros((), device=self.ctx.device)
        # Folding 1/p into the loss makes the exchanged sums means without a pass over buckets.
        # fp16 multiplies by its loss scale too; the exchanged mean is unscaled after Phase 4.
        scale = self.strategy.gradient_scale() / max(1, len(micro)) * self.precision.scale
        if self.broadcast_buffers:
            self._broadcast_buffers()
        self.buckets.arm(launch=True)  # a server runs no backward: flush launches every bucket
        # Phase 2: forward/backward; only the last micro-step launches the exchange.
        skip = False
        if self.pipeline is not None:
            started = time.perf_counter()
            assert self._driver is not None
            inputs = [a for a, _ in micro]
            total_loss, skip = self._driver.forward_backward(inputs, scale, self.num_steps + 1)
            timer.mark("backward")
            self._trace("compute", "pipeline schedule", started)
            micro = []  # done: the loop below is the one-stage path
        if micro:
            with self.memory.step() if self.memory is not None else nullcontext():
                total_loss, skip = self._forward_backward(micro, scale, timer)
        if not self.global_loss.started:  # a pipeline or a dedicated server: after Phase 2
            self._start_global_loss(total_loss)
        if not self.strategy.is_trainer:  # a dedicated server joins the trainers' agreement
            skip = self.guard.before_exchange(
                total_loss, self.strategy, self.buckets, self.ctx.group
            )
        launched_in_backward = sum(b.launched for b in self.buckets.buckets)
        if not skip:
            # Phase 3: launch the buckets unused parameters held back.
            self.buckets.flush()
            fault_at("exchange", self.num_steps + 1)
            # Phase 4: wait for the exchange; parameters no rank used get no gradient.
            waited = time.perf_counter()
            self.strategy.finish()
            timer.mark("exchange")
            end = self._trace("wait", "exchange", waited)
            if tracing:
                assert self.tracer is not None
                self.tracer.buckets(self.buckets.buckets, self._backward_started, end)
            skip = self._inspect_gradients()
        # Phase 5: update (not for a step whose loss or gradients hold inf/NaN on any rank).
        updating = time.perf_counter()
        if not skip:
            self.strategy.update(self.optimizer)
        timer.mark("optimizer")
        self._trace("optimizer", "update" if not skip else "skipped", updating)
        self.guard.count(skip, self.trainable, self.num_steps + 1, self.ctx.is_main)
        self._record(timer.read(), launched_in_backward)
        self.stats.loss = self.global_loss.finish()
        if not skip:  # every rank skips alike: the layout schedule counts updates only
            self._maybe_rebuild_buckets()
            if self.auto is not None:
                self.auto.after_update(self.num_updates, self.stats.step_s)
            self.num_updates += 1
        self.num_steps += 1
        spans = self.strategy.take_thread_spans()  # taken every step: the list stays short
        if tracing:
            assert self.tracer is not None
            for b, start, end in self.strategy.param_waits:  # inside forward's span
                self.tracer.span("wait", f"parameters b{b}", start, end, bucket=b)
            for lane, name, b, nbytes, start, end in spans:  # the communication thread's work
                self.tracer.span(lane, name, start, end, bucket=b, bytes=nbytes)
            self.tracer.finish_step(self.world.group, self._trace_meta())
        return total_loss

    def _start_global_loss(self, loss: torch.Tensor) -> None:
        """Phase 2 of the global loss: riding in the strategy's verdict where it all-reduces
        over every rank this step (no pipeline: the verdict's group is the world)."""
        one_group = self.pipeline is None and self.world.world_size == self.ctx.world_size
        rides = self.strategy.verdict_all_reduces and self.guard.inspects and one_group
        self.global_loss.start(loss, self.reports_loss, rides)

    def _trace(self, lane: str, name: str, start: float, **args: Any) -> float:
        """Record [start, now] on ``lane`` when this step is traced; returns now."""
        if self.tracer is None or not self.tracer.step:
            return time.perf_counter()
        end = self.tracer.now()
        self.tracer.span(lane, name, start, end, **args)
        return end

    def trace_input(self, start: float, end: float) -> None:
        """The Trainer's wait for the next batch, for the trace of the step that follows."""
        if self.tracer is not None and self.tracer.step:
            self.tracer.span("input", "next batch", start, end)

    def _trace_meta(self) -> dict[str, Any]:
        return {
            "strategy": type(self.strategy).__name__,
            "world_size": self.world.world_size,
            "bucket_bytes": [b.nbytes for b in self.buckets.buckets],
            "compress": self.strategy.codec.name,
            "device": str(self.ctx.device),
        }

    def _forward_backward(
        self, micro: list[Batch], scale: float, timer: PhaseTimer
    ) -> tuple[torch.Tensor, bool]:
        """Phase 2 in one process: forward and backward per micro-batch (the loss multiplied by
        ``scale``); only the last backward launches the exchange. Returns (mean loss, whether
        the step must be skipped before the exchange)."""
        total_loss = torch.zeros((), device=self.ctx.device)
        for i, batch in enumerate(micro):
            started = time.perf_counter()
            loss = self._forward(batch)
            total_loss += loss.detach() / len(micro)
            timer.mark("forward")
            self._backward_started = self._trace("compute", "forward", started, micro=i)
            last = i == len(micro) - 1
            if last:  # the global loss travels while backward runs
                self._start_global_loss(total_loss)
            if last and self.guard.before_exchange(
                total_loss, self.strategy, self.buckets, self.ctx.group
            ):
                return total_loss, True
            if last and self.guard.agrees_before_backward(self.strategy):
                self._backward_started = self._trace("wait", "agree", self._backward_started)
            self.buckets.arm(launch=last)
            if self.auto is not None:
                self.auto.before_backward(last)
            (loss * scale).backward()
            if self.auto is not None:
                self.auto.after_backward()
            timer.mark("backward")
            if not last:  # the last backward is traced per bucket, from the buckets' times
                self._trace("compute", "backward", self._backward_started, micro=i)
        return total_loss, False

    def _forward(self, batch: Batch) -> torch.Tensor:
        args, kwargs = batch
        with self.precision.autocast():
            if self.loss_fn is not None:
                inputs, targets = args
                loss = self.loss_fn(self._module(inputs), targets)
            else:
                loss = loss_of(self._module(*args, **kwargs))
        if fault_at("forward", self.num_steps + 1) == "nan":
            loss = loss * float("nan")
        return loss

    # -- the non-finite guard (phalanx.guard) --------------------------------------------------
    def _inspect_gradients(self) -> bool:
        """Phase 4 of the guard, with this step's riders (the global loss) and the pipeline's
        sum over stages; returns whether the step must be skipped."""
        riders = self.global_loss.riders()
        combine = None if self._driver is None else self._driver.combine_over_stages
        skip = self.guard.inspect(self.strategy, riders, combine, self._mirror)
        return skip

    @property
    def num_nonfinite_steps(self) -> int:
        """Steps skipped over the run (inf/NaN loss or gradients)."""
        return self.guard.num_nonfinite_steps

    @property
    def consecutive_nonfinite(self) -> int:
        return self.guard.consecutive_nonfinite

    @property
    def grad_norm(self) -> float:
        """The last step's global gradient norm (with ``max_grad_norm``; NaN otherwise)."""
        return self.guard.grad_norm

    @property
    def is_trainer(self) -> bool:
        """False on a dedicated parameter-server rank (it trains on no data)."""
        return self.strategy.is_trainer

    @property
    def reports_loss(self) -> bool:
        """Whether this rank's ``step`` returns its replica's loss (a trainer; with a pipeline,
        the rank holding the last stage)."""
        return self.is_trainer and (self.pipeline is None or self.pipeline.holds_last)

    @property
    def data_rank(self) -> int:
        """This rank's index among the ranks that train on data (for sharding the data)."""
        return self.strategy.data_parallel()[0]

    @property
    def data_world_size(self) -> int:
        """How many ranks train on data (the global batch is batch_size x this)."""
        return self.strategy.data_parallel()[1]

    def _batch(self, args: tuple, kwargs: dict[str, Any]) -> Batch:
        """The step's arguments on this rank's device, checked against how the loss is made."""
        return step_batch(args, kwargs, self.ctx.device, with_loss_fn=self.loss_fn is not None)

    def _split(self, batch: Batch) -> list[Batch]:
        return split_batch(batch, self.accumulate_steps)

    def _record(self, phases: dict[str, float], launched_in_backward: int) -> None:
        self.stats = StepStats(
            forward_s=phases.get("forward", 0.0),
            backward_s=phases.get("backward", 0.0),
            exchange_s=phases.get("exchange", 0.0),
            optimizer_s=phases.get("optimizer", 0.0),
            step_s=sum(phases.values()),
            bytes_sent=self.strategy.bytes_sent,
            bytes_received=self.strategy.bytes_received,
            num_buckets=len(self.buckets.buckets),
            buckets_launched_in_backward=launched_in_backward,
            nonfinite_messages=self.strategy.codec.num_nonfinite,
            nonfinite_skipped=self.consecutive_nonfinite > 0,
            grad_norm=self.grad_norm,
            transfer_bytes=0 if self.pipeline is None else self.pipeline.transfer_bytes(),
        )

    def _maybe_rebuild_buckets(self) -> None:
        """After the first step, re-order buckets by the observed backward order (rank 0's).

        Every rank takes part in the broadcast on step 0 whatever it observed, so ranks that
        saw different unused parameters still agree on one layout.
        """
        if self.num_updates != 0:
            return
        seen = self.buckets.ready_order
        seen_set = set(seen)
        missing = [i for i in reversed(range(len(self.trainable))) if i not in seen_set]
        order = torch.tensor(seen + missing, dtype=torch.int64, device=self.ctx.device)
        dist.broadcast(order, global_rank(self.ctx.group, 0), group=self.ctx.group)
        observed = order.tolist()
        expected = list(reversed(range(len(self.trainable))))
        if observed != expected:
            self._rebuild(observed, self.buckets.bucket_bytes)

    @property
    def auto_done(self) -> bool:
        """bucket_mb = "auto" finished choosing (always True for a fixed size)."""
        return self.auto is None or self.auto.done

    @property
    def link(self) -> LinkModel | None:
        """bucket_mb = "auto": the calibrated link (None for a fixed size)."""
        return None if self.auto is None else self.auto.link

    @property
    def threshold(self) -> Choice | None:
        """bucket_mb = "auto": the cost model's choice, once made."""
        return None if self.auto is None else self.auto.threshold

    @property
    def threshold_trials(self) -> str:
        """bucket_mb = "auto": what the timed candidate layouts measured, once decided."""
        return "" if self.auto is None else self.auto.trials_text

    def _rebuild(
        self, order: list[int], bucket_bytes: int, first_bucket_bytes: int | None = None
    ) -> None:
        """New bucket layout; parameters and optimizer state (even sharded) carry over. The
        state comes out of the memory tier / host mirror only where it follows the layout
        (sharded owners): a model whose state does not fit the device keeps it out."""
        self._sync_parameters()
        moves = self.strategy.optimizer_follows_layout
        with self._optimizer_resident() if moves else nullcontext():
            carried = self.strategy.carry_optimizer_state(self.optimizer, self.trainable)
            self.buckets.bucket_bytes = bucket_bytes
            if first_bucket_bytes is not None:
                self.buckets.first_bucket_bytes = first_bucket_bytes
            self.buckets.build(order)
            self.strategy.setup(self.ctx, self.buckets.buckets)
            self.strategy.rebind_optimizer(self.optimizer, self.trainable, carried)
        self.strategy.register_module(self._module)

    def _optimizer_resident(self) -> AbstractContextManager[None]:
        """The whole optimizer state in memory inside the block (it may live in the memory
        tier between steps: ``[memory] optimizer = "host"``)."""
        return nullcontext() if self._mirror is None else self._mirror.resident()

    # -- state --------------------------------------------------------------------------------
    def _broadcast_state(self) -> None:
        """Rank 0's parameters and buffers everywhere: one broadcast."""
        broadcast_together([*self._module.parameters(), *self._module.buffers()], self.ctx.group)

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers (e.g. BatchNorm statistics) everywhere, each step: one broadcast."""
        broadcast_together(list(self._module.buffers()), self.ctx.group)

    def state_dict(self, stored: dict[str, Any] | None = None) -> dict[str, Any]:
        """This rank's part of the Engine's state, as torch.distributed.checkpoint saves it
        (``dcp.save({"engine": engine}, planner=phalanx.checkpoint.SavePlanner())``): the
        model, the optimizer state per parameter name (per-element state in the parameter's
        shape; a sharded strategy's ranks each give only the pieces they own, as
        ``phalanx.checkpoint.Slices``, so no rank gathers the others'), the hyperparameters,
        step counts and precision state. Collective for sharded strategies: call it on every
        rank. ``stored``: the structure of a checkpoint about to be loaded (from
        ``phalanx.checkpoint.restore``); the result then says what this rank reads from it,
        on any world size and strategy."""

        self.strategy.sync()
        named = {id(p): name for name, p in self._module.named_parameters()}
        names = [named[id(p)] for p in self.trainable]
        model = self._module.state_dict()  # loads in place: the parameters themselves
        if stored is None:
            with self._optimizer_resident():  # the returned tensors outlive the block
                shards, groups = self.strategy.optimizer_shards(self.optimizer, self.trainable)
            return {
                "model": model,
                "optimizer": checkpoint.optimizer_to_dcp(shards, groups, self.trainable, names),
                "num_steps": self.num_steps,
                "num_updates": self.num_updates,
                "precision": self.precision.state_dict(),
            }
        extra = sorted(set(stored.get("model", {})) - set(model))
        if extra and getattr(self, "pipeline", None) is None:  # a stage reads its layers only
            raise CheckpointError(f"checkpoint has {extra[0]!r}, which the model does not")
        ranges = self.strategy.owned_ranges(self.trainable)
        optimizer = checkpoint.optimizer_template(
            stored.get("optimizer"), ranges, self.trainable, names
        )
        small = ("num_steps", "num_updates", "precision")
        rest = {k: checkpoint.template(stored[k]) for k in small if k in stored}
        return {"model": model, "optimizer": optimizer, **rest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict`` describes (also the gathered form of earlier versions)."""

        if not isinstance(state, dict) or not {"model", "optimizer"} <= set(state):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(
                f"load_state_dict: pass what Engine.state_dict() returned (keys 'model', "
                f"'optimizer', ...); got {got}"
            )
        self.strategy.sync()
        targets = {
            name: t.data if isinstance(t, torch.nn.Parameter) else t
            for name, t in self._module.state_dict(keep_vars=True).items()
        }
        _check_model_state(state["model"], targets)
        with torch.no_grad():  # in place: parameters may be views of strategy buffers
            for name, value in state["model"].items():
                target = targets[name]
                if target.data_ptr() != value.data_ptr() or target.shape != value.shape:
                    target.copy_(value)
        with self._optimizer_resident():
            self._load_optimizer(state["optimizer"])
        self.num_steps = int(state.get("num_steps", 0))
        self.num_updates = int(state.get("num_updates", self.num_steps))
        self.precision.load_state_dict(state.get("precision") or {})

    def _load_optimizer(self, optimizer: dict[str, Any]) -> None:
        if any(isinstance(k, int) for k in optimizer.get("state", {})) or (
            optimizer.get("param_groups") and isinstance(optimizer["param_groups"], list)
        ):  # the gathered per-index form (single-file checkpoints)
            self.strategy.load_optimizer_state_dict(self.optimizer, self.trainable, optimizer)
        else:
            named = {id(p): name for name, p in self._module.named_parameters()}
            names = [named[id(p)] for p in self.trainable]
            shards, groups = checkpoint.optimizer_from_dcp(optimizer, self.trainable, names)
            self.strategy.load_optimizer_shards(self.optimizer, self.trainable, shards, groups)

    def sync(self) -> None:
        """Wait until every parameter holds its updated value. Forward waits by itself (layer
        by layer); call this before reading parameters directly after a step."""
        self._sync_parameters()

    def _sync_parameters(self) -> None:
        if self._mirror is not None:
            self._mirror.sync()
        self.strategy.sync()

    def optimizer_bytes(self) -> int:
        """Bytes of optimizer state on this rank (in memory, plus in the memory tier)."""
        stored = 0 if self._mirror is None else self._mirror.stored_bytes()
        return self.strategy.optimizer_bytes(self.optimizer) + stored

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model, holding the updated parameters (waits for any still arriving)."""
        if not self._closed:
            self._sync_parameters()
        return self._module

    def close(self) -> None:
        """Wait for pending parameters, remove hooks and stop background work (idempotent; the
        model then works without the Engine). Runs by itself at ``phalanx.shutdown()`` and at
        interpreter exit."""
        self._unregister_teardown()
        self._teardown()

    @property
    def _closed(self) -> bool:
        """Closed by ``close()``, by shutdown or at interpreter exit."""
        return self._teardown.closed

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_model_state(state: dict[str, Any], targets: dict[str, torch.Tensor]) -> None:
    """The model part of a state must name exactly the model's tensors, in their shapes."""

    extra, missing = sorted(set(state) - set(targets)), sorted(set(targets) - set(state))
    if extra or missing:
        which = f"has {extra[0]!r}, which the model does not" if extra else f"lacks {missing[0]!r}"
        raise CheckpointError(
            f"load_state_dict: the state {which} ({len(extra)} unknown, {len(missing)} missing "
            "tensor(s)); it is from another model"
        )
    for name, value in state.items():
        if not isinstance(value, torch.Tensor) or not isinstance(targets[name], torch.Tensor):
            continue  # a module's extra state: loaded as it is
        if tuple(value.shape) != tuple(targets[name].shape):
            raise CheckpointError(
                f"load_state_dict: {name!r} has shape {tuple(value.shape)} in the state and "
                f"{tuple(targets[name].shape)} in the model; it is from another model"
            )


def _check_kinds(**arguments: tuple[Any, type | tuple[type, ...], str]) -> None:
    """One line per wrong argument type: ``name=(value, allowed types, what to pass)``; None
    always passes (every argument checked here is optional)."""
    for name, (value, kinds, wanted) in arguments.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise ConfigError(f"{name}: pass {wanted}; got {type(value).__name__} {value!r:.60}")


def rescaling_problem(
    updates_during_exchange: bool,
    who: str,
    *,
    max_grad_norm: float | None,
    precision: str,
    nonfinite: str | None,
) -> tuple[str, str] | None:
    """(key, reason) when these options cannot work together, else None. Clipping and fp16
    unscaling need the whole gradient before the update; the Engine and the CLI (which checks
    before starting workers, naming ``who``) share this rule."""
    if max_grad_norm and updates_during_exchange:
        reason = "updates parameters while gradients still arrive, before their global norm exists"
        return "max_grad_norm", f"{who} {reason}; use another strategy"
    if precision == "fp16" and updates_during_exchange:
        return "precision", (
            f"fp16 needs its loss scale removed before the update, which {who} starts while "
            "gradients still arrive; use bf16 or another strategy"
        )
    if precision == "fp16" and nonfinite == "abort":
        return "nonfinite", (
            "'abort' with precision fp16 would stop at the loss scale's first overflow; use "
            "'skip' (max_nonfinite still bounds consecutive skips)"
        )
    return None


class _Teardown:
    """Closes an Engine's parts once: pending exchanges finish, hooks go, threads stop.

    Owns the parts, not the Engine, so it still runs at ``phalanx.shutdown()`` (and interpreter
    exit) when the user dropped the Engine first: every rank then completes the last step's
    exchange before it leaves, whatever the script did after its last ``step()``."""

    def __init__(
        self,
        strategy: Strategy,
        buckets: GradientBuckets,
        pipeline: PipelineParallel | None,
        memory: MemoryManager | None,
    ) -> None:
        self.parts: tuple | None = (strategy, buckets, pipeline, memory)
        self.thread = threading.get_ident()  # the thread that built the Engine
        self.held: list[Any] = []  # the Engine's own last backend works (hold_until_shutdown)

    def hold(self, works: list[Any]) -> None:
        """Keep the Engine's last backend works (until replaced, or released at shutdown)."""
        self.held = works

    def __call__(self) -> None:
        if self.parts is None:
            return
        strategy, buckets, pipeline, memory = self.parts
        self.parts = None
        hold_until_shutdown(self.held)
        self.held = []
        try:
            strategy.close()
        finally:
            buckets.remove_hooks()
            if pipeline is not None:
                pipeline.close()
            if memory is not None:
                memory.close()

    @property
    def closed(self) -> bool:
        return self.parts is None

    def on_collected(self) -> None:
        """The Engine was garbage-collected: close now on the building thread (a collection
        elsewhere, e.g. on a communication thread that could not join itself, leaves it to
        shutdown, which still holds this teardown)."""
        if threading.get_ident() == self.thread:
            unregister_shutdown(self)
            self()


PACK_ALIGN = 16  # bytes: every tensor starts aligned in the packed buffer, so views are legal


@torch.no_grad()
def broadcast_together(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Rank 0's values of ``tensors`` (any dtypes and shapes, one device) on every rank with a
    single broadcast: their bytes travel packed in one uint8 buffer."""
    if not tensors or dist.get_world_size(group) == 1:
        return
    sizes = [t.numel() * t.element_size() for t in tensors]
    padded = [-(-n // PACK_ALIGN) * PACK_ALIGN for n in sizes]
    packed = torch.zeros(sum(padded), dtype=torch.uint8, device=tensors[0].device)
    offset = 0
    for tensor, size, room in zip(tensors, sizes, padded):
        packed[offset : offset + size] = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        offset += room
    dist.broadcast(packed, src=dist.get_global_rank(group, 0), group=group)
    offset = 0
    for tensor, size, room in zip(tensors, sizes, padded):
        piece = packed[offset : offset + size].view(tensor.dtype).view(tensor.shape)
        tensor.data.copy_(piece)
        offset += room
