"""Engine: one synchronous data-parallel training step with exchange overlapped with backward."""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from phalanx.compile import CompileClock
from phalanx.engine import checks
from phalanx.engine.auto_bucketing import DEFAULT_BUCKET_MB, AutoBucketing, ObservedOrder
from phalanx.engine.batches import (
    Accumulated,
    Batch,
    ForwardPass,
    MicroBatches,
    accumulation_scales,
    split_batch,
    step_batch,
)
from phalanx.engine.config import StepConfig, resolve_configs
from phalanx.engine.global_loss import GlobalLoss, rider_slots
from phalanx.engine.guard import NonfiniteGuard, check_rescaling
from phalanx.engine.hooks import StepEnd, StepHook
from phalanx.engine.ownership import (
    OptimizerSpec,
    StepOwnership,
    TrainableSet,
    group_of,
    resolve_optimizer,
)
from phalanx.engine.pipeline_driver import PipelineDriver
from phalanx.engine.slot import StrategySlot
from phalanx.engine.state import EngineState
from phalanx.engine.teardown import Teardown
from phalanx.engine.tracing import StepTrace, StepTracer, TraceConfig
from phalanx.errors import ConfigError, PeerLost
from phalanx.exchange.base import ExchangeConfig, Strategy, StrategyFactory, StrategyParts
from phalanx.exchange.buckets import GradientBuckets
from phalanx.exchange.comm import broadcast_together, start_broadcast_together
from phalanx.exchange.compression import Codec, make_codec
from phalanx.faults import fault_at
from phalanx.memory.manager import MemoryManager
from phalanx.metrics import PhaseTimer, StepStats
from phalanx.optim import state as optimizer_state
from phalanx.parallel.layout import ParallelConfig
from phalanx.parallel.pipeline import PipelineParallel, build_pipeline
from phalanx.precision import Precision
from phalanx.runtime.context import Context, current_context, on_shutdown

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


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

    Configuration: ``exchange`` (a name, a StrategyFactory or an ExchangeConfig) and ``step`` (a
    StepConfig), validated once; keyword shorthand for their keys (``bucket_mb=``, ...).
    Components act at fixed points of the step (step hooks, phalanx.engine.hooks): the observed
    bucket order, ``bucket_mb = "auto"``, traces; the non-finite guard, the global loss and
    the pipeline driver are called where their results decide the step.

    With ``parallel`` (pipeline > 1, phalanx.parallel) Phase 2 is torch's pipeline schedule over
    this rank's stages and the Engine's world is the mesh's data sub-group; with ``memory`` (a
    MemoryManager, phalanx.memory) Phase 2 runs inside its offload/recompute plan.

    Lifecycle, reads of the model while owner updates travel back, and rebuilds that keep
    ``engine.optimizer`` the same object: docs/engine.md.
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
        checks.check_arguments(model, loss_fn, optimizer)
        if not hasattr(model, "no_sync"):  # a ported DDP loop's `with model.no_sync():`
            model.__dict__["no_sync"] = checks.PointToEngine("no_sync")
        checks.check_kinds(
            step=step, memory=memory, trace=trace, parallel=parallel, context=context
        )
        self.factory, exchange_config, self.config = resolve_configs(exchange, step, options)
        bucket_mb = exchange_config.bucket_mb
        self.ctx = context or current_context()
        self.world = self.ctx  # every process; self.ctx becomes the data-parallel group
        self.pipeline: PipelineParallel | None = None
        if parallel is not None and parallel.enabled:
            checks.check_pipeline(bucket_mb, loss_fn, memory, return_outputs)
            assert loss_fn is not None  # refused above with one line
            self.pipeline = build_pipeline(model, loss_fn, parallel, self.ctx, sample_input, stages)
            model, self.ctx = self.pipeline.local, self.pipeline.data_context
        checks.check_memory(memory, self.ctx.device, self.factory)
        self.memory = memory
        # This rank's model (a pipeline's stages); reads of updated parameters: ``module``.
        self.local_module = model.to(self.ctx.device)
        # [train] compile: each layer's forward, before any component hooks in (hooks outside)
        compiling = self.config.compile
        self.compiled = self.factory.compile_model(self.local_module) if compiling else []
        self._compile_clock = CompileClock() if compiling else None
        self.loss_fn = loss_fn
        self._batch = functools.partial(  # the step's arguments on the device, checked
            step_batch, device=self.ctx.device, with_loss_fn=loss_fn is not None
        )
        self.accumulate_steps = self.config.accumulate_steps
        # DDP's no_sync: micro-batches accumulated since the last update, and their loss sum
        self._syncing = True
        self._pending = MicroBatches(self.ctx.device)
        # rank 0's buffers (BatchNorm statistics, as this update's forwards left them) go to
        # every rank after each update, so whatever reads the model next sees rank 0's (DDP's)
        self._buffers = list(model.buffers()) if self.config.broadcast_buffers else []
        self.precision = Precision(self.config.precision, self.ctx.device)
        self.guard = NonfiniteGuard(self.config, self.precision)
        self.forward = ForwardPass(self.local_module, loss_fn, self.precision, return_outputs)
        check_rescaling(self.factory.cls, self.guard, self.precision)
        codec = make_codec(exchange_config.compress)  # the same across rebuilds
        self.stats = StepStats()
        self.num_steps = 0  # steps run (what fault points and guard messages count, 0-based)
        self.num_updates = 0  # steps whose update was applied (the auto layout's schedule)
        broadcast_together([*model.parameters(), *model.buffers()], self.ctx.group)
        self.trainable = [p for p in self.local_module.parameters() if p.requires_grad]
        riders = rider_slots(self.factory.sums_whole_buckets(codec), self.pipeline, model)
        self.buckets = _buckets(
            exchange_config, self.factory, codec, self.ctx, self.trainable, riders
        )
        self.slot, self.optimizer, user_order = _adopt_optimizer(
            optimizer, self.factory, self.ctx, self.buckets, self.local_module, self.trainable,
            codec, self.pipeline,
        )  # fmt: skip
        self._driver: PipelineDriver | None = None  # Phase 2 with pipeline > 1 (a component)
        if self.pipeline is not None:
            parts_ = (self.buckets, self.slot, self.guard, self.precision, self.world)
            self._driver = PipelineDriver(self.pipeline, *parts_)
        # [memory] optimizer: the state in the memory tier between steps (stream), or the
        # masters, state and arithmetic on the host (mirror; layers wait in forward pre-hooks).
        mirror = None if memory is None else memory.attach_optimizer(self.optimizer, model)
        if mirror is not None:  # gradients to the host as each bucket's exchange ends
            mirror.listen(self.strategy)
        self.strategy.register_module(self.local_module)
        self._trainable_set = TrainableSet(self.local_module, self.optimizer)
        # Closing must not depend on this object (a script may drop its Engine while an exchange
        # is pending): the teardown owns the parts; it runs at shutdown or when collected.
        self._teardown = Teardown(self.slot, self.buckets, self.pipeline, self.memory)
        teardown = self._teardown  # (the hook must not hold the Engine: it closes when dropped)
        self._step_ownership = StepOwnership(self.optimizer, lambda: teardown.closed)
        self._unregister_teardown = on_shutdown(self._teardown)
        weakref.finalize(self, self._teardown.on_collected).atexit = False
        self.state = EngineState(
            slot=self.slot, module=self.local_module, optimizer=self.optimizer,
            trainable=self.trainable, precision=self.precision, mirror=mirror,
            user_order=user_order, strategy_name=self.factory.name,
            shards_parameters=self.factory.cls.shards_parameters,
            stages=self.pipeline is not None, world_size=self.ctx.world_size,
            closed=lambda: teardown.closed,
        )  # fmt: skip
        self._timer = PhaseTimer(self.ctx.device)
        # The step's mean loss over every rank (engine.stats.loss): a component.
        self.global_loss = GlobalLoss(self.world, keep=self._teardown.hold)
        self._stop_vote = False  # request_stop(): sent with the next step's global loss
        # The step's components, in the order they run at each hook point (holding the
        # Engine's rebuild weakly: a component must not keep the Engine alive).
        rebuild = _weak_method(self._rebuild)
        self.auto = _auto_bucketing(bucket_mb, self.ctx, self.buckets, self.trainable, rebuild)
        self.trace = StepTrace(_tracer(trace, self.ctx), self.slot, self.buckets, self.world)
        order = ObservedOrder(self.ctx, self.buckets, len(self.buckets.params), rebuild)
        self.hooks: list[StepHook] = [
            *([order] if self.buckets.params else []),  # a layout to observe
            *([self.auto] if self.auto else []),
            self.trace,
        ]

    @property
    def strategy(self) -> Strategy:
        """The current exchange strategy (a bucket rebuild replaces it: hold ``slot``)."""
        return self.slot.current

    # -- the step -----------------------------------------------------------------------------
    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Train on one batch; returns this rank's mean loss (a detached 0-dim tensor), or with
        ``return_outputs=True`` ``(loss, outputs)`` (detached; a list per micro-batch).
        ``step(inputs, targets)`` with a ``loss_fn``; without one the arguments go to the
        model, whose output holds the loss (phalanx.engine.batches.loss_of). Inside ``with
        engine.no_sync():`` forward and backward only (DDP's accumulation)."""
        checks.refuse_closed(self._teardown.closed)
        clock = self._compile_clock
        self._step_ownership.inside = True
        try:
            with nullcontext() if clock is None else clock.measure():
                return self._step(args, kwargs)
        except RuntimeError as e:  # the backend's words for a peer that went away
            lost = PeerLost.from_backend(e, self.num_steps + 1)
            if lost is None:
                raise
            raise lost from e
        finally:
            self._step_ownership.inside = False

    def _step(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        if not self._syncing:
            return self._accumulate(args, kwargs)
        timer = self._timer
        timer.start()
        for hook in self.hooks:
            hook.begin(self.num_steps + 1)
        # (train/eval modes are the user's, as under DDP: e.g. a frozen BatchNorm in eval)
        self._trainable_set.check(self.num_steps + 1)
        # Phase 1: zero buckets (unless no_sync's micro-batches accumulated into them); split
        # into micro-batches.
        carried = self._pending.take()
        pending = carried.micro
        if not pending:
            self.buckets.zero()
        self.strategy.begin_step()
        if self.state.mirror is not None:
            self.state.mirror.begin_step()
        micro = []
        if self.strategy.is_trainer:  # a dedicated server has no batch, only its exchange part
            micro = split_batch(self._batch(args, kwargs), self.accumulate_steps)
        # Folding 1/p into the loss makes the exchanged sums means without a pass over buckets.
        # fp16 multiplies by its loss scale too; the exchanged mean is unscaled after Phase 4.
        divisor, post_scale = accumulation_scales(pending, len(micro) + pending, self.buckets)
        scale = self.strategy.gradient_scale() / divisor * self.precision.scale
        self.buckets.arm(launch=True)  # a server runs no backward: flush launches every bucket
        # Phase 2: forward/backward; only the last micro-step launches the exchange.
        total_loss, skip = torch.zeros((), device=self.ctx.device), False
        own = total_loss
        if self._driver is not None:
            inputs = [a for a, _ in micro]
            total_loss, skip = self._driver.run(inputs, scale, self.num_steps + 1, self.trace)
            own = total_loss
            timer.mark("backward")
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
            start_broadcast_together(self._buffers, self.ctx.group)()
        # Phase 5: update (not for a step whose loss or gradients hold inf/NaN on any rank).
        updating = time.perf_counter()
        if not skip:
            self.strategy.update(self.optimizer)
        timer.mark("optimizer")
        self.trace.span("optimizer", "update" if not skip else "skipped", updating)
        self.guard.count(skip, self.trainable, self.num_steps + 1, self.ctx.is_main)
        # (no local may hold the strategy past here: a rebuild at the hooks' end frees it)
        self.stats = _stats(timer.read(), launched_in_backward, self)
        self.stats.loss = self.global_loss.finish(exchanged=not skipped_before_exchange)
        self.stats.stop_requested = self.global_loss.stop_votes > 0
        end = StepEnd(self.num_steps + 1, not skip, self.num_updates, self.stats)
        for hook in self.hooks:
            hook.end(end)
        self.num_updates += not skip
        self.num_steps += 1
        return self.forward.result(own)  # this call's micro-batches' mean loss

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's gradient accumulation: each ``step`` inside runs forward and backward only and
        returns its own loss; the next ``step`` outside updates with the mean gradient over
        every micro-batch since the last update. On every rank alike (DDP's no_sync)."""
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
            return self.forward.result(zero)
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
                loss = self.forward(batch, self.num_steps + 1)
                total = total + loss.detach()
                self.strategy.before_backward(False)
                (loss * scale).backward()
        self._pending.add(total, len(micro))
        return self.forward.result(total / len(micro))

    def _exchange(self, timer: PhaseTimer, post_scale: float) -> bool:
        """Phases 3 and 4; returns whether the step must be skipped (the guard's verdict)."""
        # Phase 3: launch the buckets unused parameters held back; rank 0's buffers leave.
        self.buckets.flush()
        buffers_shared = start_broadcast_together(self._buffers, self.ctx.group)
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
        skip = self.guard.inspect(self.strategy, riders, combine, self.state.mirror)
        buffers_shared()
        return skip

    def _start_global_loss(self, loss: torch.Tensor) -> None:
        """Phase 2 of the global loss: in the last bucket's slots, else the verdict, else alone."""
        last = self.buckets.buckets[-1] if self.buckets.buckets else None
        slots = None if last is None else last.riders
        one_group = self.pipeline is None and self.world.world_size == self.ctx.world_size
        verdict = self.strategy.verdict_all_reduces and self.guard.inspects and one_group
        stop = self._stop_vote
        self.global_loss.start(loss, self.reports_loss, stop, slots=slots, verdict=verdict)

    def request_stop(self) -> None:
        """Ask every rank to stop (e.g. on SIGTERM): the vote rides with the next step's global
        loss, after which ``stats.stop_requested`` is True on every rank, at the same step."""
        self._stop_vote = True

    def _forward_backward(
        self, micro: list[Batch], scale: float, timer: PhaseTimer, carried: Accumulated
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Phase 2 in one process (losses times ``scale``; the last backward launches the
        exchange). ``carried``: what ``no_sync`` ran for this update. Returns (this call's mean
        loss, the update's, whether the step must be skipped before the exchange)."""
        own = torch.zeros((), device=self.ctx.device)
        total_loss = own  # the same tensor, unless no_sync ran micro-batches for this update
        trace = self.trace
        for i, batch in enumerate(micro):
            started = time.perf_counter()
            loss = self.forward(batch, self.num_steps + 1)
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

    # -- what the step's components report ----------------------------------------------------
    @property
    def compile_s(self) -> float | None:
        """Seconds torch spent compiling in this Engine's steps (None without ``compile``)."""
        return None if self._compile_clock is None else self._compile_clock.seconds

    @property
    def is_trainer(self) -> bool:
        """False on a dedicated parameter-server rank (it trains on no data)."""
        return self.strategy.is_trainer

    @property
    def reports_loss(self) -> bool:
        """Whether this rank's ``step`` returns its replica's loss (a pipeline's last stage)."""
        return self.is_trainer and (self.pipeline is None or self.pipeline.holds_last)

    @property
    def data_rank(self) -> int:
        """This rank's index among the ranks that train on data (for sharding the data)."""
        return self.strategy.data_parallel()[0]

    @property
    def data_world_size(self) -> int:
        """How many ranks train on data (the global batch is batch_size x this)."""
        return self.strategy.data_parallel()[1]

    def _rebuild(
        self, order: list[int], bucket_bytes: int, first_bucket_bytes: int | None = None
    ) -> None:
        """New bucket layout; parameters and optimizer state (even sharded) carry over, out of
        the memory tier only where the state follows the layout (sharded owners)."""
        self.state.sync()
        moves = self.strategy.optimizer_follows_layout
        with self.state.resident() if moves else nullcontext():
            carried = self.strategy.carry_optimizer_state(self.optimizer, self.trainable)
            self.buckets.bucket_bytes = bucket_bytes
            if first_bucket_bytes is not None:
                self.buckets.first_bucket_bytes = first_bucket_bytes
            self.buckets.build(order)
            self.slot.rebuild()  # every holder reads the slot: nothing keeps the old one
            self.strategy.rebind_optimizer(self.optimizer, self.trainable, carried)
        self.strategy.register_module(self.local_module)

    # -- state (phalanx.engine.state) ---------------------------------------------------------
    def state_dict(self, stored: dict[str, Any] | None = None) -> dict[str, Any]:
        """This rank's part of the Engine's state for DCP (``EngineState.state_dict``)."""
        with self.strategy.own_reads():  # fsdp refuses the user's reads of its shards
            return self.state.state_dict(stored, self.num_steps, self.num_updates)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict`` describes (``EngineState.load_state_dict``)."""
        with self.strategy.own_reads():
            self.num_steps, self.num_updates = self.state.load_state_dict(state)

    def full_state_dict(self) -> dict[str, Any]:
        """``model.state_dict()`` as one process gives it (this rank's stages under a pipeline).
        Under ``fsdp`` a collective: call it on every rank, then save from one."""
        return self.state.full_state_dict()

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state as ``optimizer.state_dict()`` gives it in one process (torch's
        format, the user's groups; loads anywhere). Collective under ``partitioned``, ``ps``
        and ``fsdp``: call it on every rank, then save from one."""
        return self.state.optimizer_state_dict()

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``optimizer_state_dict`` returns; on every rank."""
        self.state.load_optimizer_state_dict(state)

    def sync(self) -> None:
        """Wait until every parameter holds its updated value. Forward waits by itself (layer
        by layer); call this before reading parameters directly after a step."""
        self.state.sync()

    def optimizer_bytes(self) -> int:
        """Bytes of optimizer state on this rank (in memory, plus in the memory tier)."""
        return self.state.optimizer_bytes()

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model, holding the updated parameters (waits for any still arriving)."""
        self.state.sync()
        return self.strategy.read_module(self.local_module)

    @property
    def forward_module(self) -> torch.nn.Module:
        """The module that runs this rank's forward outside a step (validation): the model
        itself, or with ``fsdp`` its shards (each unit gathered as it runs, on every rank)."""
        self.state.sync()
        return self.strategy.forward_module(self.local_module)

    def close(self) -> None:
        """Wait for pending parameters, remove hooks and stop background work (idempotent; the
        model then works without the Engine). Runs by itself at ``phalanx.shutdown()`` and at
        interpreter exit."""
        self._unregister_teardown()
        self._teardown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stats(phases: dict[str, float], launched: int, engine: Engine) -> StepStats:
    """The step's StepStats from its phase times and its components' counters."""
    strategy, pipeline = engine.strategy, engine.pipeline
    return StepStats(
        forward_s=phases.get("forward", 0.0),
        backward_s=phases.get("backward", 0.0),
        exchange_s=phases.get("exchange", 0.0),
        optimizer_s=phases.get("optimizer", 0.0),
        step_s=sum(phases.values()),
        bytes_sent=strategy.bytes_sent,
        bytes_received=strategy.bytes_received,
        num_buckets=len(engine.buckets.buckets),
        buckets_launched_in_backward=launched,
        nonfinite_messages=strategy.codec.num_nonfinite,
        nonfinite_skipped=engine.guard.consecutive_nonfinite > 0,
        grad_norm=engine.guard.grad_norm,
        transfer_bytes=0 if pipeline is None else pipeline.transfer_bytes(),
    )


def _weak_method(method: Callable[..., None]) -> Callable[..., None]:
    """``method`` (bound) without a reference to its object: an Engine whose components hold
    it is still freed as soon as the script drops it (and then closes itself)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def _buckets(
    config: ExchangeConfig,
    factory: StrategyFactory,
    codec: Codec,
    ctx: Context,
    trainable: list[torch.nn.Parameter],
    riders: int,
) -> GradientBuckets:
    """The fusion buckets over ``trainable`` (none where the strategy exchanges each unit's
    gradients itself), ``riders`` slots in the last (the global loss); they launch into the
    strategy slot once it is built."""
    checks.check_bucket_size(config.bucket_mb, factory)
    bucket_mb = DEFAULT_BUCKET_MB if config.bucket_mb == checks.AUTO else float(config.bucket_mb)
    return GradientBuckets(
        [] if factory.cls.shards_parameters else trainable,
        int(bucket_mb * 2**20),
        launch=lambda bucket: None,
        align=factory.bucket_alignment(ctx.world_size, ctx.backend, codec),
        first_bucket_bytes=int(config.first_bucket_mb * 2**20),
        riders=riders,
    )


def _auto_bucketing(
    bucket_mb: float | str,
    ctx: Context,
    buckets: GradientBuckets,
    trainable: list[torch.nn.Parameter],
    rebuild: Callable[..., None],
) -> AutoBucketing | None:
    """bucket_mb = "auto" (F12): measure the link now, profile backward in the first steps,
    then choose the threshold and time the candidate layouts."""
    return AutoBucketing(ctx, buckets, trainable, rebuild) if bucket_mb == checks.AUTO else None


def _tracer(trace: TraceConfig | None, ctx: Context) -> StepTracer | None:
    enabled = trace is not None and trace.enabled
    return StepTracer(trace, ctx.rank, ctx.device) if trace is not None and enabled else None


def _adopt_optimizer(
    spec: OptimizerSpec | None,
    factory: StrategyFactory,
    ctx: Context,
    buckets: GradientBuckets,
    module: torch.nn.Module,
    trainable: list[torch.nn.Parameter],
    codec: Codec,
    pipeline: PipelineParallel | None,
) -> tuple[StrategySlot, torch.optim.Optimizer, Any]:
    """The strategy (built in its slot) takes the user's optimizer over ``trainable``, checked:
    sharded strategies cut their shards where its groups change, re-point it at this rank's
    shards, split the state it already holds (resuming) and keep the user's numbering of the
    parameters (for optimizer_state_dict). Returns (slot, optimizer, that numbering or None).
    Under ``fsdp`` ``trainable`` becomes the model's sharded parameters, in place."""
    shards = factory.cls.optimizer_follows_layout
    user = resolve_optimizer(spec, trainable, strategy=factory.name, shards=shards)
    user_order = optimizer_state.user_order(user, trainable) if shards else None
    parts = StrategyParts(
        codec=codec,
        group_of=group_of(user) if shards else None,
        module=module,
        entries=None if pipeline is None else list(pipeline.stages.values()),
    )
    resumed = shards and any(user.state.values())
    carried = optimizer_state.canonical_of(user, trainable) if resumed else None
    slot = StrategySlot(factory, ctx, buckets, parts)
    strategy = slot.current
    if pipeline is not None and strategy.data_parallel()[1] != ctx.world_size:
        raise ConfigError(
            "exchange.strategy: dedicated parameter servers train no stage; with pipeline "
            "> 1 every rank must train (ps with servers = 0)"
        )
    adopted = strategy.adopt_optimizer(user, trainable)
    if shards:  # its own state_dict() would hold this rank's shards only: refused
        optimizer_state.refuse_direct_state(adopted, factory.name)
    if carried is not None:  # split over this rank's shards
        strategy.load_optimizer_state_dict(adopted, trainable, carried)
    if factory.cls.shards_parameters:  # the model's parameters are the shards now
        trainable[:] = [p for p in module.parameters() if p.requires_grad]
    return slot, adopted, user_order
