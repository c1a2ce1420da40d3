"""Engine: one synchronous data-parallel training step with exchange overlapped with backward."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from phalanx.compile import CompileClock
from phalanx.engine import state as engine_state
from phalanx.engine.auto_bucketing import DEFAULT_BUCKET_MB, AutoBucketing, ObservedOrder
from phalanx.engine.batches import (
    Accumulated,
    Batch,
    MicroBatches,
    detached,
    loss_of,
    split_batch,
    step_batch,
)
from phalanx.engine.config import StepConfig
from phalanx.engine.global_loss import SLOTS as LOSS_SLOTS
from phalanx.engine.global_loss import GlobalLoss
from phalanx.engine.guard import NonfiniteGuard, rescaling_problem
from phalanx.engine.hooks import StepEnd, StepHook
from phalanx.engine.pipeline_driver import PipelineDriver
from phalanx.engine.teardown import Teardown
from phalanx.engine.tracing import StepTrace, StepTracer, TraceConfig
from phalanx.errors import PEER_LOSS, CheckpointError, ConfigError, PeerLost, PhalanxError
from phalanx.exchange.base import (
    STRATEGIES,
    ExchangeConfig,
    Strategy,
    StrategyFactory,
    StrategyParts,
    strategy_factory,
)
from phalanx.exchange.buckets import GradientBuckets
from phalanx.exchange.comm import broadcast_together, start_broadcast_together
from phalanx.exchange.compression import Codec, make_codec
from phalanx.exchange.link import LinkModel
from phalanx.exchange.threshold import Choice
from phalanx.faults import fault_at
from phalanx.fields import with_options
from phalanx.memory.manager import MemoryManager
from phalanx.memory.residency import OptimizerResidency
from phalanx.metrics import PhaseTimer, StepStats
from phalanx.optim import state as optimizer_state
from phalanx.optim.user import (
    OptimizerSpec,
    StepOwnership,
    TrainableSet,
    group_of,
    resolve_optimizer,
)
from phalanx.parallel.layout import ParallelConfig
from phalanx.parallel.pipeline import PipelineParallel, build_pipeline
from phalanx.precision import Precision
from phalanx.runtime.context import Context, current_context, on_shutdown

logger = logging.getLogger("phalanx")
AUTO = "auto"
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
# The keyword shorthand of Engine(...): each key's Config (the rest of ExchangeConfig's keys
# and the strategy's options come with ``exchange``).
STEP_OPTIONS = frozenset(f for f in StepConfig.__dataclass_fields__)
EXCHANGE_OPTIONS = frozenset({"bucket_mb", "compress", "first_bucket_mb"})


class Engine:
    """Wraps a model, a loss and the user's optimizer; ``step`` trains on one batch.

    Phases of ``step(inputs, targets)`` (inputs: (B, ...) on any device; targets: (B, ...)):
      Phase 1: zero the gradient buckets; split the batch into ``accumulate_steps`` micro-batches.
      Phase 2: forward + backward per micro-batch (the loss scaled by the strategy's 1/p, so
        exchanged sums are means); on the last one, backward hooks hand each full bucket to
        the exchange strategy while backward continues (overlap, F8).
      Phase 3: launch the buckets unused parameters held back (zeros in their place).
      Phase 4: wait for the exchange (the exposed part is ``stats.exchange_s``); parameters no
        rank used (per the buckets' summed usage flags) keep ``grad = None``.
      Phase 5: update (the strategy applies the optimizer).
    A step inside ``with engine.no_sync():`` (DDP's accumulation shape) runs Phase 2 alone, at
    the full loss scale; the next step rescales what it left in the buckets (Phase 1).
    Parameters and buffers are broadcast from rank 0 at construction so all replicas start equal.

    Configuration: ``exchange`` (a registry name, a StrategyFactory, or an ExchangeConfig such as a
    run's ``[exchange]``) and ``step`` (a StepConfig such as a run's ``[train]``), validated
    once by those Configs; keyword shorthand for their keys (``bucket_mb=``, ``compress=``,
    ``accumulate_steps=``, ``precision=``, ``max_grad_norm=``, ...) replaces them.
    Components act at fixed points of the step (step hooks, phalanx.engine.hooks): the observed
    bucket order, ``bucket_mb = "auto"``, traces; the non-finite guard, the global loss and
    the pipeline driver are called where their results decide the step.

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
        exchange: str | StrategyFactory | ExchangeConfig = "allreduce",
        step: StepConfig | None = None,
        context: Context | None = None,
        parallel: ParallelConfig | None = None,
        stages: list[int] | None = None,
        sample_input: Any = None,
        memory: MemoryManager | None = None,
        trace: TraceConfig | None = None,
        return_outputs: bool = False,
        **options: Any,
    ) -> None:
        _check_arguments(model, loss_fn, optimizer)
        if not hasattr(model, "no_sync"):  # a ported DDP loop's `with model.no_sync():`
            model.__dict__["no_sync"] = _PointToEngine("no_sync")
        _check_kinds(
            step=(step, StepConfig, "a phalanx.engine.config.StepConfig (e.g. a run's [train])"),
            memory=(memory, MemoryManager, "a phalanx.memory.manager.MemoryManager or None"),
            trace=(trace, TraceConfig, "a phalanx.engine.tracing.TraceConfig or None"),
            parallel=(parallel, ParallelConfig, "a phalanx.parallel.layout.ParallelConfig or None"),
            context=(context, Context, "the Context of phalanx.init() or None"),
        )
        self.factory, exchange_config, self.config = _configs(exchange, step, options)
        bucket_mb = exchange_config.bucket_mb
        self.ctx = context or current_context()
        self.world = self.ctx  # every process; self.ctx becomes the data-parallel group
        self.pipeline: PipelineParallel | None = None
        if parallel is not None and parallel.enabled:
            _check_pipeline(bucket_mb, loss_fn, memory)
            assert loss_fn is not None  # refused above with one line
            self.pipeline = build_pipeline(model, loss_fn, parallel, self.ctx, sample_input, stages)
            model, self.ctx = self.pipeline.local, self.pipeline.data_context
        _check_memory_device(memory, self.ctx.device)
        if memory is not None and self.factory.cls.shards_parameters:
            _check_sharded_memory(memory, self.factory.name)
        self.memory = memory
        # This rank's model (a pipeline's stages); reads that must see the updated parameters
        # go through ``module``.
        self.local_module = model.to(self.ctx.device)
        # [train] compile: each layer's forward, before any component hooks into the model
        # (their hooks stay outside the compiled code); torch compiles in the first step.
        self.compiled: list[torch.nn.Module] = []
        self._compile_clock: CompileClock | None = None
        if self.config.compile:
            self.compiled = self.factory.compile_model(self.local_module)
            self._compile_clock = CompileClock()
        self.loss_fn = loss_fn
        self.accumulate_steps = self.config.accumulate_steps
        if return_outputs and self.pipeline is not None:
            raise ConfigError(
                "return_outputs: with pipeline > 1 the outputs exist on the last stage's "
                "ranks only; compute what you need from them in loss_fn"
            )
        self.return_outputs = return_outputs
        self._outputs: list[Any] = []  # this step's micro-batches' outputs (return_outputs)
        # DDP's no_sync: micro-batches accumulated since the last update, and their loss sum
        self._syncing = True
        self._pending = MicroBatches(self.ctx.device)
        self.broadcast_buffers = self.config.broadcast_buffers and any(
            True for _ in model.buffers()
        )
        self.precision = Precision(self.config.precision, self.ctx.device)
        self.guard = NonfiniteGuard(self.config, self.precision)
        self._check_rescaling()
        self._codec = make_codec(exchange_config.compress)  # the same across rebuilds
        self.stats = StepStats()
        self.num_steps = 0  # steps run (what fault points and guard messages count, 0-based)
        self.num_updates = 0  # steps whose update was applied (the auto layout's schedule)
        broadcast_together([*model.parameters(), *model.buffers()], self.ctx.group)
        self.trainable = [p for p in self.local_module.parameters() if p.requires_grad]
        shards_parameters = self.factory.cls.shards_parameters  # no buckets: it exchanges itself
        if shards_parameters and bucket_mb == AUTO:
            raise ConfigError(
                f"bucket_mb: {self.factory.name!r} exchanges each unit's gradients itself, with "
                "no fusion buckets to size; leave bucket_mb at a size"
            )
        self.buckets = GradientBuckets(
            [] if shards_parameters else self.trainable,
            int((DEFAULT_BUCKET_MB if bucket_mb == AUTO else float(bucket_mb)) * 2**20),
            launch=lambda bucket: None,  # the strategy's, once built
            align=self.factory.bucket_alignment(self.ctx.world_size, self.ctx.backend, self._codec),
            first_bucket_bytes=int(exchange_config.first_bucket_mb * 2**20),
            riders=_loss_riders(self.factory, self._codec, self.pipeline, model),
        )
        self.optimizer = self._adopt_optimizer(optimizer)
        self._driver: PipelineDriver | None = None  # Phase 2 with pipeline > 1 (a component)
        if self.pipeline is not None:
            parts = (self.buckets, self.strategy, self.guard, self.precision, self.world)
            self._driver = PipelineDriver(self.pipeline, *parts)
        # [memory] optimizer: the state in the memory tier between steps (stream), or the
        # masters, state and arithmetic on the host (mirror; layers wait in forward pre-hooks).
        self._mirror: OptimizerResidency | None = (
            None if memory is None else memory.attach_optimizer(self.optimizer, self.local_module)
        )
        if self._mirror is not None:  # gradients to the host as each bucket's exchange ends
            self._mirror.listen(self.strategy)
        self.strategy.register_module(self.local_module)
        self._trainable_set = TrainableSet(self.local_module, self.optimizer)
        # Closing must not depend on this object: a script's ranks may drop their Engine (return
        # from main) while an exchange is still pending. The teardown owns the parts and runs
        # at shutdown, or as soon as the Engine is collected on the thread that built it.
        self._teardown = Teardown(self.strategy, self.buckets, self.pipeline, self.memory)
        teardown = self._teardown  # (the hook must not hold the Engine: it closes when dropped)
        self._step_ownership = StepOwnership(self.optimizer, lambda: teardown.closed)
        self._unregister_teardown = on_shutdown(self._teardown)
        weakref.finalize(self, self._teardown.on_collected).atexit = False
        self._timer = PhaseTimer(self.ctx.device)
        # The step's mean loss over every rank (engine.stats.loss): a component.
        self.global_loss = GlobalLoss(self.world, keep=self._teardown.hold)
        self._stop_vote = False  # request_stop(): sent with the next step's global loss
        self._build_hooks(bucket_mb, trace)

    def _adopt_optimizer(self, optimizer: OptimizerSpec | None) -> torch.optim.Optimizer:
        """Build the strategy, then hand it the user's optimizer over the model's parameters
        (instance or factory), checked: sharded strategies cut their shards where its
        parameter groups change."""
        factory = self.factory
        shards = factory.cls.optimizer_follows_layout
        user_optimizer = resolve_optimizer(
            optimizer, self.trainable, strategy=factory.name, shards=shards
        )
        self._group_of = group_of(user_optimizer) if shards else None
        # Sharded: the user's numbering of the parameters (for optimizer_state_dict), and the
        # state of an optimizer the script loaded before building the Engine (resuming).
        self._user_order = (
            optimizer_state.user_order(user_optimizer, self.trainable) if shards else None
        )
        resumed = shards and any(user_optimizer.state.values())
        carried = optimizer_state.canonical_of(user_optimizer, self.trainable) if resumed else None
        self.strategy = self._build_strategy(previous=None)
        if self.pipeline is not None and self.strategy.data_parallel()[1] != self.ctx.world_size:
            raise ConfigError(
                "exchange.strategy: dedicated parameter servers train no stage; with pipeline "
                "> 1 every rank must train (ps with servers = 0)"
            )
        adopted = self.strategy.adopt_optimizer(user_optimizer, self.trainable)
        if shards:  # its own state_dict() would hold this rank's shards only: refused
            optimizer_state.refuse_direct_state(adopted, factory.name)
        if carried is not None:  # split over this rank's shards
            self.strategy.load_optimizer_state_dict(adopted, self.trainable, carried)
        if factory.cls.shards_parameters:  # the model's parameters are the shards now
            self.trainable = [p for p in self.local_module.parameters() if p.requires_grad]
        return adopted

    def _build_strategy(self, previous: Strategy | None) -> Strategy:
        """The strategy whole, on the buckets' current layout (``previous``: the one it
        replaces; its thread and listeners carry over). The buckets launch into it."""
        parts = StrategyParts(
            codec=self._codec,
            group_of=self._group_of,
            previous=previous,
            module=self.local_module,
            entries=None if self.pipeline is None else list(self.pipeline.stages.values()),
        )
        strategy = self.factory(self.ctx, self.buckets.buckets, parts)
        self.buckets.launch = strategy.launch
        return strategy

    def _build_hooks(self, bucket_mb: float | str, trace: TraceConfig | None) -> None:
        """The step's components, in the order they run at each hook point."""
        rebuild = _weak_method(self._rebuild)  # a component must not keep the Engine alive
        order = ObservedOrder(self.ctx, self.buckets, len(self.buckets.params), rebuild)
        # bucket_mb = "auto" (F12): measure the link now, profile backward in the first steps,
        # then choose the threshold and time the candidate layouts.
        self.auto: AutoBucketing | None = None
        if bucket_mb == AUTO:
            self.auto = AutoBucketing(self.ctx, self.buckets, self.trainable, rebuild)
        tracer = None
        if trace is not None and trace.enabled:
            tracer = StepTracer(trace, self.ctx.rank, self.ctx.device)
        self.trace = StepTrace(tracer, self.strategy, self.buckets, self.world)
        self.hooks: list[StepHook] = [
            *([order] if self.buckets.params else []),  # a layout to observe
            *([self.auto] if self.auto else []),
            self.trace,
        ]

    def _check_rescaling(self) -> None:
        problem = rescaling_problem(
            self.factory.cls.updates_during_exchange,
            self.factory.cls.__name__,
            max_grad_norm=self.guard.max_grad_norm,
            precision=self.precision.name,
            nonfinite=self.guard.nonfinite,
        )
        if problem is not None:
            raise ConfigError(f"{problem[0]}: {problem[1]}")

    # -- the step -----------------------------------------------------------------------------
    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Train on one batch; returns this rank's mean loss (a detached 0-dim tensor), or with
        ``return_outputs=True`` ``(loss, outputs)``: the model's output detached (with
        ``accumulate_steps`` > 1, a list of each micro-batch's), e.g. for an accuracy.

        With a ``loss_fn``: ``step(inputs, targets)`` computes ``loss_fn(model(inputs),
        targets)``. Without one, the arguments go to the model as they are
        (``step(idx, targets)``, ``step(**batch)``) and the model's output is the loss: a
        0-dim tensor, an object or dict with a ``loss`` (Hugging Face), or a tuple holding one
        0-dim tensor (``(logits, loss)``). Inside ``with engine.no_sync():`` it runs forward
        and backward only (DDP's accumulation)."""
        if self._closed:
            raise ConfigError(
                "step: this Engine is closed (by close(), phalanx.shutdown(), "
                "dist.destroy_process_group() or the end of its with block); build a new Engine "
                "to train again"
            )
        clock = self._compile_clock
        self._step_ownership.inside = True
        try:
            with nullcontext() if clock is None else clock.measure():
                return self._step(args, kwargs)
        except RuntimeError as e:  # the backend's words for a peer that went away
            first_line = str(e).splitlines()[0] if str(e) else ""
            if isinstance(e, PhalanxError) or not any(p in first_line.lower() for p in PEER_LOSS):
                raise
            said = first_line.split("] ", 1)[-1].split(". ", 1)[0]  # no source path, 1 sentence
            raise PeerLost(self.num_steps + 1, said[:160]) from e
        finally:
            self._step_ownership.inside = False

    def _step(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        if not self._syncing:
            return self._accumulate(args, kwargs)
        timer = self._timer
        timer.start()
        for hook in self.hooks:
            hook.begin(self.num_steps + 1)
        # (The model's train/eval modes are the user's, as in a plain loop and under DDP: a
        # script may keep a submodule in eval mode, e.g. a frozen BatchNorm.)
        self._trainable_set.check(self.num_steps + 1)
        # Phase 1: zero buckets (unless no_sync's micro-batches accumulated into them); split
        # into micro-batches.
        carried = self._pending.take()
        pending = carried.micro
        if not pending:
            self.buckets.zero()
        self.strategy.begin_step()
        if self._mirror is not None:
            self._mirror.begin_step()
        micro = []
        if self.strategy.is_trainer:  # a dedicated server has no batch, only its exchange part
            micro = split_batch(self._batch(args, kwargs), self.accumulate_steps)
        # Folding 1/p into the loss makes the exchanged sums means without a pass over buckets.
        # fp16 multiplies by its loss scale too; the exchanged mean is unscaled after Phase 4.
        divisor, post_scale = self._accumulation_scales(pending, len(micro) + pending)
        scale = self.strategy.gradient_scale() / divisor * self.precision.scale
        self.buckets.arm(launch=True)  # a server runs no backward: flush launches every bucket
        # Phase 2: forward/backward; only the last micro-step launches the exchange.
        total_loss, skip = torch.zeros((), device=self.ctx.device), False
        own = total_loss
        if self._driver is not None:
            started = time.perf_counter()
            inputs = [a for a, _ in micro]
            total_loss, skip = self._driver.forward_backward(inputs, scale, self.num_steps + 1)
            own = total_loss
            timer.mark("backward")
            self.trace.span("compute", "pipeline schedule", started)
        elif micro:
            with self.memory.step() if self.memory is not None else nullcontext():
                own, total_loss, skip = self._forward_backward(micro, scale, timer, carried)
        if not self.global_loss.started:  # a pipeline or a dedicated server: after Phase 2
            self._start_global_loss(total_loss)
        if not self.strategy.is_trainer:  # a dedicated server joins the trainers' agreement
            skip = self.guard.before_exchange(
                total_loss, self.strategy, self.buckets, self.ctx.group
            )
        launched_in_backward = sum(b.launched for b in self.buckets.buckets)
        skipped_before_exchange = skip
        if not skip:
            skip = self._exchange(timer, post_scale)
        else:
            self._share_buffers()()
        # Phase 5: update (not for a step whose loss or gradients hold inf/NaN on any rank).
        updating = time.perf_counter()
        if not skip:
            self.strategy.update(self.optimizer)
        timer.mark("optimizer")
        self.trace.span("optimizer", "update" if not skip else "skipped", updating)
        self.guard.count(skip, self.trainable, self.num_steps + 1, self.ctx.is_main)
        self._record(timer.read(), launched_in_backward)
        self.stats.loss = self.global_loss.finish(exchanged=not skipped_before_exchange)
        self.stats.stop_requested = self.global_loss.stop_votes > 0
        end = StepEnd(self.num_steps + 1, not skip, self.num_updates, self.stats)
        for hook in self.hooks:
            hook.end(end)
        self.num_updates += not skip
        self.num_steps += 1
        return self._result(own)  # this call's micro-batches' mean loss

    def _result(self, loss: torch.Tensor) -> Any:
        """``step``'s value: the loss, or (loss, outputs) with ``return_outputs``."""
        if not self.return_outputs:
            return loss
        outputs, self._outputs = self._outputs, []
        return loss, outputs[0] if len(outputs) == 1 else outputs

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's gradient accumulation: each ``step`` inside the block runs forward and backward
        only (gradients add up on this rank; no exchange, no update) and returns its own loss;
        the next ``step`` outside it exchanges and updates with the mean gradient over every
        micro-batch since the last update, as ``accumulate_steps`` would. Call it on every
        rank alike (as DDP's ``model.no_sync()``)."""
        if self.pipeline is not None:
            raise ConfigError(
                "no_sync: a pipeline's schedule runs a step's micro-batches together; use "
                "accumulate_steps with pipeline > 1"
            )
        previous, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = previous

    def _accumulate(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """A ``step`` under ``no_sync``: Phase 2 of the step without the exchange."""
        zero = torch.zeros((), device=self.ctx.device)
        if not self.strategy.is_trainer:  # a dedicated server: nothing until the exchange
            return self._result(zero)
        self._trainable_set.check(self.num_steps + 1)
        micro = split_batch(self._batch(args, kwargs), self.accumulate_steps)
        if self._pending.count == 0:  # the update's first micro-batch (Phase 1)
            self.buckets.zero()
        self.buckets.arm(launch=False)
        # Each micro-batch at the full scale; the step that updates divides by their count.
        scale = self.strategy.gradient_scale() * self.precision.scale
        total = zero
        with self.memory.step() if self.memory is not None else nullcontext():
            for batch in micro:
                loss = self._forward(batch)
                total = total + loss.detach()
                self.strategy.before_backward(False)
                (loss * scale).backward()
        self._pending.add(total, len(micro))
        return self._result(total / len(micro))

    def _accumulation_scales(self, pending: int, count: int) -> tuple[float, float]:
        """Phase 1: (what this step's loss scale is divided by, a factor for the exchanged
        gradient) so the update's gradient is the mean over its ``count`` micro-batches, of
        which ``no_sync`` ran ``pending`` at the full scale. Where buckets hold those, they
        are scaled now; where none does (fsdp), everything is scaled after the exchange."""
        if not pending:
            return max(1, count), 1.0
        if not self.buckets.buckets:
            return 1.0, 1.0 / count
        for bucket in self.buckets.buckets:
            bucket.grads.mul_(1.0 / count)
        return count, 1.0

    def _exchange(self, timer: PhaseTimer, post_scale: float) -> bool:
        """Phases 3 and 4; returns whether the step must be skipped (the guard's verdict)."""
        # Phase 3: launch the buckets unused parameters held back; rank 0's buffers leave.
        self.buckets.flush()
        buffers_shared = self._share_buffers()
        fault_at("exchange", self.num_steps + 1)
        # Phase 4: wait for the exchange; parameters no rank used get no gradient.
        self.trace.waiting_for_exchange()
        self.strategy.finish()
        if post_scale != 1.0:  # no_sync's micro-batches where no bucket held them (fsdp)
            self.strategy.scale_gradients(post_scale)
        timer.mark("exchange")
        for hook in self.hooks:
            hook.after_exchange()
        riders = self.global_loss.riders()  # the global loss rides in the guard's verdict
        combine = None if self._driver is None else self._driver.combine_over_stages
        skip = self.guard.inspect(self.strategy, riders, combine, self._mirror)
        buffers_shared()
        return skip

    def _share_buffers(self) -> Callable[[], None]:
        """Phase 3: rank 0's buffers (BatchNorm statistics, as this update's forwards left
        them) start towards every rank, so whatever reads the model next (the next step, a
        validation in eval mode, a checkpoint from any rank) sees rank 0's, as under DDP
        (whose next forward broadcasts them). Launched after every bucket (the same order of
        collectives on every rank); returns the function that waits and writes them."""
        if not self.broadcast_buffers:
            return lambda: None
        return start_broadcast_together(list(self.local_module.buffers()), self.ctx.group)

    def _start_global_loss(self, loss: torch.Tensor) -> None:
        """Phase 2 of the global loss: riding in the last bucket where the strategy sums
        whole buckets (the buckets carry its slots only then), else in the strategy's verdict
        where it all-reduces over every rank this step (no pipeline: the verdict's group is
        the world)."""
        last = self.buckets.buckets[-1] if self.buckets.buckets else None
        slots = None if last is None else last.riders
        one_group = self.pipeline is None and self.world.world_size == self.ctx.world_size
        verdict = self.strategy.verdict_all_reduces and self.guard.inspects and one_group
        stop = self._stop_vote
        self.global_loss.start(loss, self.reports_loss, stop, slots=slots, verdict=verdict)

    def request_stop(self) -> None:
        """Ask every rank to stop (a SIGTERM's handler may call it): this rank's vote travels
        with the next step's global loss, after which ``stats.stop_requested`` is True on
        every rank, so all stop at the same step with no collective of their own."""
        self._stop_vote = True

    def trace_input(self, start: float, end: float) -> None:
        """The Trainer's wait for the next batch, for the trace of the step that follows."""
        self.trace.input(start, end)

    @property
    def tracer(self) -> StepTracer | None:
        """The traces' collector (None when not tracing)."""
        return self.trace.tracer

    @tracer.setter
    def tracer(self, tracer: StepTracer | None) -> None:
        self.trace.tracer = tracer

    def _forward_backward(
        self, micro: list[Batch], scale: float, timer: PhaseTimer, carried: Accumulated
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Phase 2 in one process: forward and backward per micro-batch (the loss multiplied by
        ``scale``); only the last backward launches the exchange. ``carried``: micro-batches
        ``no_sync`` ran for this update. Returns (this call's mean loss, the update's, whether
        the step must be skipped before the exchange)."""
        own = torch.zeros((), device=self.ctx.device)
        total_loss = own  # the same tensor, unless no_sync ran micro-batches for this update
        trace = self.trace
        for i, batch in enumerate(micro):
            started = time.perf_counter()
            loss = self._forward(batch)
            own += loss.detach() / len(micro)
            timer.mark("forward")
            trace.backward_started = trace.span("compute", "forward", started, micro=i)
            last = i == len(micro) - 1
            if last and carried.micro:  # the update's mean over no_sync's micro-batches too
                total_loss = (carried.loss_sum + own * len(micro)) / (carried.micro + len(micro))
            if last:  # the global loss travels while backward runs
                self._start_global_loss(total_loss)
            if last and self.guard.before_exchange(
                total_loss, self.strategy, self.buckets, self.ctx.group
            ):
                return own, total_loss, True
            if last and self.guard.agrees_before_backward(self.strategy):
                trace.backward_started = trace.span("wait", "agree", trace.backward_started)
            self.buckets.arm(launch=last)
            self.strategy.before_backward(last)
            for hook in self.hooks:
                hook.before_backward(last)
            (loss * scale).backward()
            for hook in self.hooks:
                hook.after_backward()
            timer.mark("backward")
            # the last backward is traced per bucket, from the buckets' times; without buckets
            # (fsdp: torch's hooks reduce-scatter inside backward) it is one span too
            if not last or not self.buckets.buckets:
                trace.span("compute", "backward", trace.backward_started, micro=i)
        return own, total_loss, False

    def _forward(self, batch: Batch) -> torch.Tensor:
        args, kwargs = batch
        with self.precision.autocast():
            if self.loss_fn is not None:
                inputs, targets = args
                output = self.local_module(inputs)
                loss = self.loss_fn(output, targets)
            else:
                output = self.local_module(*args, **kwargs)
                loss = loss_of(output)
        if self.return_outputs:
            self._outputs.append(detached(output))
        if fault_at("forward", self.num_steps + 1) == "nan":
            loss = loss * float("nan")
        return loss

    # -- what the step's components report ----------------------------------------------------
    @property
    def compile_s(self) -> float | None:
        """Seconds torch spent compiling in this Engine's steps (``compile``; None without):
        nearly all of it in the first step."""
        return None if self._compile_clock is None else self._compile_clock.seconds

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

    def _batch(self, args: tuple, kwargs: dict[str, Any]) -> Batch:
        """The step's arguments on this rank's device, checked against how the loss is made."""
        return step_batch(args, kwargs, self.ctx.device, with_loss_fn=self.loss_fn is not None)

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

    def _rebuild(
        self, order: list[int], bucket_bytes: int, first_bucket_bytes: int | None = None
    ) -> None:
        """New bucket layout; parameters and optimizer state (even sharded) carry over. The
        state comes out of the memory tier / host mirror only where it follows the layout
        (sharded owners): a model whose state does not fit the device keeps it out."""
        self._sync_parameters()
        moves = self.strategy.optimizer_follows_layout
        with self.optimizer_resident() if moves else nullcontext():
            carried = self.strategy.carry_optimizer_state(self.optimizer, self.trainable)
            self.buckets.bucket_bytes = bucket_bytes
            if first_bucket_bytes is not None:
                self.buckets.first_bucket_bytes = first_bucket_bytes
            self.buckets.build(order)
            self._replace_strategy()
            self.strategy.rebind_optimizer(self.optimizer, self.trainable, carried)
        self.strategy.register_module(self.local_module)

    def _replace_strategy(self) -> None:
        """A strategy built for the new layout takes the old one's place everywhere."""
        old = self.strategy
        self.strategy = self._build_strategy(previous=old)
        old.close()  # its hooks go; its thread now belongs to the new one
        self._teardown.replace_strategy(self.strategy)
        self.trace.strategy = self.strategy
        if self._driver is not None:
            self._driver.strategy = self.strategy

    def optimizer_resident(self) -> AbstractContextManager[None]:
        """The whole optimizer state in memory inside the block (it may live in the memory
        tier between steps: ``[memory] optimizer = "host"``)."""
        return nullcontext() if self._mirror is None else self._mirror.resident()

    def lazy_optimizer_shards(self) -> tuple[dict[int, dict[str, Any]], list[Any]] | None:
        """The optimizer state for a checkpoint that reads it from its memory tier piece by
        piece (``[memory] optimizer = "host"`` on a CPU), or None: ``optimizer_resident``."""
        return None if self._mirror is None else self._mirror.lazy_shards(self.trainable)

    # -- state (phalanx.engine.state) ---------------------------------------------------------
    def state_dict(self, stored: dict[str, Any] | None = None) -> dict[str, Any]:
        """This rank's part of the Engine's state for torch.distributed.checkpoint (see
        ``phalanx.engine.state.state_dict``); collective for sharded strategies."""
        with self.strategy.own_reads():  # fsdp refuses the user's reads of its shards
            return engine_state.state_dict(self, stored)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict`` describes (also the gathered form of earlier versions)."""
        with self.strategy.own_reads():
            engine_state.load_state_dict(self, state)

    def full_state_dict(self) -> dict[str, Any]:
        """``model.state_dict()`` as one process gives it: whole tensors, the model's own names
        (this rank's stages under a pipeline). Under ``fsdp`` a collective that gathers every
        rank's rows onto the CPU: call it on every rank, then save from one."""
        self._refuse_gather_when_closed("full_state_dict", self.factory.cls.shards_parameters)
        if not self._closed:
            self._sync_parameters()
        return self.strategy.full_state_dict(self.local_module)

    def _refuse_gather_when_closed(self, what: str, gathers: bool) -> None:
        """A read that ``gathers`` from every rank cannot run once the group is gone."""
        if gathers and self.ctx.world_size > 1 and not dist.is_initialized():
            raise CheckpointError(
                f"{what}: under {self.factory.name!r} it gathers from every rank, and the "
                "process group is gone (dist.destroy_process_group() or phalanx.shutdown() "
                "ran); call it on every rank before that"
            )

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state as ``optimizer.state_dict()`` gives it in one process: torch's
        format for your optimizer over the model's parameters, your groups and their
        hyperparameters, per-parameter state in the parameters' shapes. Loads into the same
        optimizer built over the model anywhere (before an Engine is built over it, under any
        strategy and world size). Collective under ``partitioned``, ``ps`` and ``fsdp``, whose
        ranks each hold their shards' state: call it on every rank, then save from one."""
        sharded = self._user_order is not None or self.factory.cls.shards_parameters
        self._refuse_gather_when_closed("optimizer_state_dict", sharded)
        self.strategy.sync()
        try:
            with self.optimizer_resident():
                state = self.strategy.optimizer_state_dict(self.optimizer, self.trainable)
        except RuntimeError as e:  # the backend's words for a peer that did not take part
            if self._user_order is None:
                raise
            raise CheckpointError(
                f"optimizer_state_dict: under {self.factory.name!r} it gathers every rank's "
                "shards, and a rank did not take part (it left or was elsewhere); call it on "
                f"every rank, then save from one ({str(e).splitlines()[0][:160]})"
            ) from e
        if self._user_order is None:  # the optimizer is over the model's own parameters
            return state
        return optimizer_state.to_torch_format(state, self._user_order)

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``optimizer_state_dict`` returns (or ``optimizer.state_dict()`` of the
        same optimizer in one process); on every rank."""
        self.strategy.sync()
        if self._user_order is not None:
            state = optimizer_state.from_torch_format(state, self._user_order)
        with self.optimizer_resident():
            self.strategy.load_optimizer_state_dict(self.optimizer, self.trainable, state)

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
        return self.strategy.read_module(self.local_module)

    @property
    def forward_module(self) -> torch.nn.Module:
        """The module that runs this rank's forward outside a step (validation): the model
        itself, or with ``fsdp`` its shards (each unit gathered as it runs, on every rank)."""
        if not self._closed:
            self._sync_parameters()
        return self.strategy.forward_module(self.local_module)

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


class _PointToEngine:
    """Stands in for a DDP method on the user's model and names the Engine's (picklable: a
    whole-model ``torch.save`` still works)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(
            f"model.{self.name}: the model is not wrapped in DDP; use `with "
            f"engine.{self.name}():` around engine.step(...) (each step inside runs forward "
            "and backward only)"
        )


def _configs(
    exchange: str | StrategyFactory | ExchangeConfig,
    step: StepConfig | None,
    options: dict[str, Any],
) -> tuple[StrategyFactory, ExchangeConfig, StepConfig]:
    """The strategy's factory and the two Configs from ``exchange``, ``step`` and the keyword
    shorthand (each key type-checked and validated by its Config; one line naming a bad one)."""
    unknown = sorted(set(options) - STEP_OPTIONS - EXCHANGE_OPTIONS)
    if unknown:
        allowed = ", ".join(sorted(STEP_OPTIONS | EXCHANGE_OPTIONS))
        raise ConfigError(f"{unknown[0]}: not an Engine argument; allowed: {allowed}")
    if options.get("max_grad_norm", 0.0) is None:
        options = {**options, "max_grad_norm": 0.0}  # None and 0: no clipping
    step_options = {k: v for k, v in options.items() if k in STEP_OPTIONS}
    exchange_options = {k: v for k, v in options.items() if k in EXCHANGE_OPTIONS}
    config = with_options(step if step is not None else StepConfig(), step_options)
    if isinstance(exchange, str):
        STRATEGIES.get(exchange)  # one line naming the known strategies
        exchange = ExchangeConfig(strategy=exchange)
    if isinstance(exchange, ExchangeConfig):
        exchange_config = with_options(exchange, exchange_options)
        factory = strategy_factory(exchange_config.strategy, exchange_config.options)
        return factory, exchange_config, config
    if not isinstance(exchange, StrategyFactory):
        raise ConfigError(
            "exchange: pass a strategy name, an ExchangeConfig or a phalanx.exchange."
            f"strategy_factory(name, options); got {type(exchange).__name__}"
        )
    return exchange, with_options(ExchangeConfig(), exchange_options), config


def _loss_riders(
    factory: StrategyFactory, codec: Codec, pipeline: PipelineParallel | None, model: Any
) -> int:
    """Slots for the global loss in the last bucket: where the strategy sums whole buckets
    exactly (uncompressed) over the world (no pipeline) in fp32 or fp64 (a bf16 bucket would
    round the loss)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    exact = all(p.dtype in (torch.float32, torch.float64) for p in trained)
    summed = pipeline is None and factory.sums_whole_buckets(codec)
    return LOSS_SLOTS if summed and exact else 0


def _weak_method(method: Callable[..., None]) -> Callable[..., None]:
    """``method`` (bound) without a reference to its object: an Engine whose components hold
    it is still freed as soon as the script drops it (and then closes itself)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def _check_arguments(model: Any, loss_fn: Any, optimizer: Any) -> None:
    """The positional arguments' kinds, one line each."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model: pass a torch.nn.Module; got {type(model).__name__}")
    _refuse_wrapped(model)
    if optimizer is None:
        raise ConfigError(
            "optimizer: required; pass the optimizer built over model.parameters() or a "
            "factory params -> Optimizer"
        )
    if isinstance(loss_fn, type) and issubclass(loss_fn, torch.nn.Module):
        raise ConfigError(  # the class is callable too: its first step would fail inside torch
            f"loss_fn: pass an instance, {loss_fn.__name__}(), not the class {loss_fn.__name__}"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(
            f"loss_fn: pass a function (output, targets) -> loss, or None when the model "
            f"returns its own loss; got {type(loss_fn).__name__}"
        )
    for name, sub in model.named_modules():
        if getattr(sub, "sparse", False) is True and isinstance(
            sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)
        ):
            if sub.weight.requires_grad:
                raise ConfigError(
                    f"model: {name or 'the model'} ({type(sub).__name__}) has sparse=True, "
                    "whose sparse gradients phalanx does not exchange (its buckets are dense); "
                    "build it with sparse=False"
                )


def _refuse_wrapped(model: torch.nn.Module) -> None:
    """A model another data-parallel wrapper still holds: its own hooks would exchange (and
    average) the gradients a second time, or shard what phalanx expects whole."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    wrappers = (
        torch.nn.parallel.DistributedDataParallel,
        torch.nn.DataParallel,
        FullyShardedDataParallel,
    )
    if isinstance(inner, wrappers):
        name = type(inner).__name__
        raise ConfigError(
            f"model: it is wrapped in {name}, which would exchange the gradients again; pass "
            f"the model itself (model.module), and drop the {name}(...) line"
        )
    if any(isinstance(m, FSDPModule) for m in inner.modules()):  # fully_shard's
        raise ConfigError(
            "model: fully_shard() was applied to it; pass the model before sharding (phalanx "
            "shards it itself with exchange='fsdp')"
        )


def _check_pipeline(bucket_mb: float | str, loss_fn: Any, memory: Any) -> None:
    """What pipeline > 1 cannot run with, one line each."""
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
    if memory is not None:
        raise ConfigError(
            "memory: the memory manager works on one stage per model copy; use it with pipeline = 1"
        )


def _check_kinds(**arguments: tuple[Any, type | tuple[type, ...], str]) -> None:
    """One line per wrong argument type: ``name=(value, allowed types, what to pass)``; None
    always passes (every argument checked here is optional)."""
    for name, (value, kinds, wanted) in arguments.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise ConfigError(f"{name}: pass {wanted}; got {type(value).__name__} {value!r:.60}")


def _check_memory_device(memory: MemoryManager | None, device: torch.device) -> None:
    """A memory manager plans for one device: the Engine's (its tier and mirror depend on it)."""
    if memory is not None and memory.device is not None and memory.device.type != device.type:
        raise ConfigError(
            f"memory: the MemoryManager was built for {memory.device.type} but the Engine runs "
            f"on {device}; build it with the Engine's device (phalanx.init().device)"
        )


def _check_sharded_memory(memory: MemoryManager, strategy: str) -> None:
    """A strategy that shards the optimizer state over the ranks keeps it where its shards are."""
    if memory.optimizer_place != "device":
        raise ConfigError(
            f"memory.optimizer: {strategy!r} shards the optimizer state over the data ranks "
            "already; use memory.optimizer = 'device' (activation offload and recompute work)"
        )
