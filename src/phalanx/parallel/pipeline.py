"""Model parallelism: this rank's stages of a pipelined model, run by torch's schedules (F6, F7).

Phase 1 (layout): a ("data", "pipeline") DeviceMesh; the data group is the Engine's world.
Phase 2 (trace): a sample micro-batch through the model gives each boundary's shape, dtype.
Phase 3 (stages): this rank's stages, layers under the model's own names, + TransferLayers.
Phase 4 (step): torch's schedule runs the micro-batches; the Engine hears of the last backward.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from phalanx.errors import ConfigError
from phalanx.exchange.comm import global_rank
from phalanx.models.modes import evaluating
from phalanx.parallel.layout import ParallelConfig, check_stage_count
from phalanx.parallel.pipeline_schedules import schedule_kind
from phalanx.parallel.split import balanced_split, describe_split, even_split, profile_layers
from phalanx.parallel.transfer import TransferLayer
from phalanx.runtime.context import Context

_AGREE_TAG = 0x5048  # sum_over_stages' messages, apart from the schedule's activations

logger = logging.getLogger("phalanx")
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Boundary:
    """The activation leaving stage ``src`` for stage ``src + 1``: one micro-batch's shape."""

    src: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class LocalLayers(nn.Module):
    """This rank's layers under the whole model's names, so its state dict is its part of the
    one-process model's; forward runs through the pipeline, never here."""

    def __init__(self, named: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        for name, layer in named:
            self.add_module(name, layer)

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("a pipeline stage's layers run through engine.step, not directly")


def trace_boundaries(layers: list[nn.Module], stage_of: list[int], sample: Any) -> list[Boundary]:
    """Phase 2: what crosses each stage boundary for ``sample``, then the model's output;
    ConfigError where a boundary follows an output that is not a single tensor."""
    boundaries, x = [], sample
    with torch.no_grad():
        for i, layer in enumerate(layers):
            x = layer(x)
            if i + 1 == len(layers) and isinstance(x, torch.Tensor):
                boundaries.append(Boundary(stage_of[i], tuple(x.shape), x.dtype))
            last_of_stage = i + 1 < len(layers) and stage_of[i + 1] != stage_of[i]
            if not last_of_stage:
                continue
            if not isinstance(x, torch.Tensor):
                raise ConfigError(
                    f"model.layers[{i}]: its output ({type(x).__name__}) cannot cross the "
                    f"boundary to stage {stage_of[i + 1]}: only a single tensor can; move the "
                    "boundary"
                )
            boundaries.append(Boundary(stage_of[i], tuple(x.shape), x.dtype))
    return boundaries


def describe_stages(
    stage_of: list[int], boundaries: list[Boundary], rank_of: Callable[[int], int]
) -> str:
    """One line per stage: its layers, its pipeline rank and the transfer leaving it."""
    lines = []
    for s in range(max(stage_of) + 1):
        members = [i for i, k in enumerate(stage_of) if k == s]
        line = f"  stage {s} on pipeline rank {rank_of(s)}: layers {members[0]}-{members[-1]}"
        if s < max(stage_of) and rank_of(s + 1) != rank_of(s):
            b = boundaries[s]
            line += f", then {TransferLayer(s, s + 1, b.shape, b.dtype)}"
        elif s < max(stage_of):
            line += f", then stage {s + 1} on the same rank (no transfer)"
        lines.append(line)
    return "\n".join(lines)


def pipelined_view(
    layers: list[nn.Module],
    stage_of: list[int],
    boundaries: list[Boundary],
    rank_of: Callable[[int], int] | None = None,
) -> nn.Sequential:
    """The whole model for display, a TransferLayer at each boundary between ranks
    (``rank_of`` None: each stage on its own rank)."""
    children: OrderedDict[str, nn.Module] = OrderedDict()
    for i, layer in enumerate(layers):
        children[str(i)] = layer
        s = stage_of[i]
        if i + 1 < len(layers) and stage_of[i + 1] != s and _crosses(s, rank_of):
            b = boundaries[s]
            children[f"transfer{s}"] = TransferLayer(b.src, b.src + 1, b.shape, b.dtype)
    return nn.Sequential(children)


def _crosses(stage: int, rank_of: Callable[[int], int] | None) -> bool:
    """Whether ``stage``'s output goes to another rank (not a V's middle, handed in memory)."""
    return rank_of is None or rank_of(stage + 1) != rank_of(stage)


class BackwardListener(Protocol):
    """What hears of a stage's backward passes during ``PipelineParallel.step``."""

    def before_backward(self, last_backward: bool) -> None:
        """Before a stage's backward pass (``last_backward``: its last this step)."""

    def grads_written(self, params: list[nn.Parameter]) -> None:
        """Zero-bubble schedules' weight-gradient pass writes ``.grad`` itself, past autograd's
        accumulation and so past post-accumulate-grad hooks: these parameters were written."""


class _Deaf:
    def before_backward(self, last_backward: bool) -> None:
        pass

    def grads_written(self, params: list[nn.Parameter]) -> None:
        pass


_NO_LISTENER: BackwardListener = _Deaf()


class PipelineParallel:
    """This rank's part of a P-stage pipeline replicated D times. ``layers``: the whole model
    (built alike on every rank); ``stage_of[i]``: layer i's stage; ``sample``: one micro-batch."""

    def __init__(
        self,
        layers: list[nn.Module],
        stage_of: list[int],
        parallel: ParallelConfig,
        world: Context,
        sample: Any,
        loss_fn: LossFn,
    ) -> None:
        self.parallel = parallel
        self.kind = schedule_kind(parallel.schedule)
        self.num_ranks = parallel.pipeline
        self.num_stages = parallel.num_stages
        self.num_microbatches = parallel.num_microbatches
        check_stage_count(len(layers), self.num_stages)
        if len(stage_of) != len(layers) or sorted(set(stage_of)) != list(range(self.num_stages)):
            raise ConfigError(
                f"model.layers: stages {sorted(set(stage_of))} do not cover "
                f"0..{self.num_stages - 1}"
            )
        # Phase 1: layout.
        self.world = world
        self.num_replicas = parallel.replicas(world.world_size)
        self.data_group, self.pipe_group = _mesh_groups(world, self.num_replicas, self.num_ranks)
        self.data_context = dataclasses.replace(
            world,
            rank=dist.get_rank(self.data_group),
            world_size=self.num_replicas,
            group=self.data_group,
        )
        self.pipe_rank = dist.get_rank(self.pipe_group)
        # Phase 2: trace on the CPU copy every rank built.
        self.boundaries = trace_boundaries(layers, stage_of, sample)
        self.sample_meta = Boundary(-1, tuple(sample.shape), sample.dtype)
        # Phase 3: keep this rank's stages.
        self.stage_ids = [
            s for s in range(self.num_stages) if parallel.rank_of_stage(s) == self.pipe_rank
        ]
        self.stages: dict[int, nn.Sequential] = {}
        named: list[tuple[str, nn.Module]] = []
        for s in self.stage_ids:
            members = [(str(i), layer) for i, layer in enumerate(layers) if stage_of[i] == s]
            named += members
            children: OrderedDict[str, nn.Module] = OrderedDict(members)
            if s + 1 < self.num_stages and _crosses(s, parallel.rank_of_stage):
                b = self.boundaries[s]
                children["transfer"] = TransferLayer(s, s + 1, b.shape, b.dtype)
            self.stages[s] = nn.Sequential(children).to(world.device)
        self.local = LocalLayers(named)
        self.stage_of = list(stage_of)
        self.split_measured = ""  # what split = "auto" measured, when it chose the stages
        self._schedule: Any = None
        self._scale = 1.0
        self._losses: list[torch.Tensor] = []
        self._loss_fn = loss_fn
        self._agreement_sends: tuple[torch.Tensor | None, list[Any]] = (None, [])
        self._listener: BackwardListener = _NO_LISTENER  # the current ``step``'s
        # Benchmarks: compute time per step (the bubble measurable); on CUDA it synchronizes.
        self.measure_busy = False
        self.busy_s = 0.0
        # The same time per pass kind ("forward", and torch's backward types "full", "input",
        # "weight"): [seconds, passes]; zero-bubble claims assume forward = input = weight.
        self.busy_by_pass: dict[str, list[float]] = {}
        for stage in self.stages.values():
            stage.register_forward_pre_hook(self._start_busy)
            stage.register_forward_hook(self._stop_busy)
        self._busy_since = 0.0

    # -- what this rank holds -----------------------------------------------------------------
    @property
    def holds_first(self) -> bool:
        return 0 in self.stages

    @property
    def holds_last(self) -> bool:
        return self.num_stages - 1 in self.stages

    @property
    def num_crossings(self) -> int:
        """Stage boundaries of this replica whose activation goes to another rank."""
        rank_of = self.parallel.rank_of_stage
        return sum(rank_of(s + 1) != rank_of(s) for s in range(self.num_stages - 1))

    @property
    def transfers(self) -> list[TransferLayer]:
        return [m for stage in self.stages.values() for m in stage if isinstance(m, TransferLayer)]

    def reset_counts(self) -> None:
        """Start counting a new step's transfer bytes (and busy time)."""
        for t in self.transfers:
            t.reset_counts()
        self.busy_s = 0.0
        self.busy_by_pass = {}

    def _start_busy(self, *args: Any) -> None:
        if self.measure_busy:
            self._busy_since = self._clock()

    def _stop_busy(self, *args: Any, kind: str = "forward") -> None:
        if self.measure_busy:
            seconds = self._clock() - self._busy_since
            self.busy_s += seconds
            total = self.busy_by_pass.setdefault(kind, [0.0, 0])
            total[0] += seconds
            total[1] += 1

    def _clock(self) -> float:
        if self.world.device.type == "cuda":
            torch.cuda.synchronize(self.world.device)
        return time.perf_counter()

    def transfer_bytes(self) -> int:
        """Bytes across this rank's outgoing links this step, both directions."""
        return sum(t.bytes_forward + t.bytes_backward for t in self.transfers)

    # -- Phase 4: one step --------------------------------------------------------------------
    def step(
        self,
        inputs: Any,
        targets: torch.Tensor,
        scale: float,
        listener: BackwardListener | None = None,
    ) -> torch.Tensor:
        """One replica batch in micro-batches; ``.grad`` accumulates x ``scale / micro-batches``;
        the mean loss on the last stage's rank (zero elsewhere)."""
        if self._schedule is None:
            self._schedule = self._build_schedule()
        self._scale = scale / self.num_microbatches
        self._losses = []
        args = (_standard_strides(inputs),) if self.holds_first else ()
        target = targets if self.holds_last else None
        self._listener = listener or _NO_LISTENER
        try:
            self._schedule.step(*args, target=target, losses=[] if self.holds_last else None)
        finally:
            self._listener = _NO_LISTENER
        if not self._losses:
            return torch.zeros((), device=self.world.device)
        return torch.stack(self._losses).mean()

    def losses_finite(self) -> bool:
        """Whether every micro-batch loss so far this step is finite (True where none)."""
        return not self._losses or bool(torch.isfinite(torch.stack(self._losses)).all())

    def sum_over_stages(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (small float64, this device) summed over the replica's pipeline ranks.

        Rooted at pipeline rank 0, which runs every schedule's final backward: the others send
        as they finish; the root sends the sum without waiting for it to land (an all-reduce
        would put a round trip on its path to the optimizer step)."""
        group, size = self.pipe_group, dist.get_world_size(self.pipe_group)
        self._wait_agreement_sends()
        if dist.get_rank(group) != 0:
            root = global_rank(group, 0)
            dist.send(values, root, group=group, tag=_AGREE_TAG)
            total = torch.empty_like(values)
            dist.recv(total, root, group=group, tag=_AGREE_TAG)
            return total
        total, incoming = values.clone(), torch.empty_like(values)
        for r in range(1, size):
            dist.recv(incoming, global_rank(group, r), group=group, tag=_AGREE_TAG)
            total += incoming
        sends = [
            dist.isend(total, global_rank(group, r), group=group, tag=_AGREE_TAG)
            for r in range(1, size)
        ]
        self._agreement_sends = (total, sends)  # the tensor must outlive the sends
        return total.clone()

    def close(self) -> None:
        """Complete this rank's last messages (the Engine's close)."""
        self._wait_agreement_sends()

    def _wait_agreement_sends(self) -> None:
        _, sends = self._agreement_sends
        for work in sends:
            work.wait()
        self._agreement_sends = (None, [])

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor, **kwargs: Any) -> Any:
        loss = self._loss_fn(output, target)
        self._losses.append(loss.detach().float())
        return loss * self._scale

    def _build_schedule(self) -> Any:
        stages = [
            _notifying_stage_class()(
                self,
                self.stages[s],
                s,
                self.num_stages,
                self.world.device,
                group=self.pipe_group,
                input_args=_example(self.sample_meta if s == 0 else self.boundaries[s - 1]),
                output_args=_example(self.boundaries[s]) if s < len(self.boundaries) else None,
            )
            for s in self.stage_ids
        ]
        return self.kind.build(stages, self.num_microbatches, self._scaled_loss)

    # -- forward only (validation) --------------------------------------------------------------
    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """The model's output for ``x`` (any batch size, same on the replica's ranks) in eval
        mode on the last stage's rank, None elsewhere."""
        with evaluating(self.local):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor | None:
        act: torch.Tensor | None = x.to(self.world.device) if self.holds_first else None
        for s in range(self.num_stages):
            if s not in self.stages:
                continue
            if s > 0 and s - 1 not in self.stages:
                b = self.boundaries[s - 1]
                act = torch.empty(
                    (x.shape[0], *b.shape[1:]), dtype=b.dtype, device=self.world.device
                )
                dist.recv(act, self._rank_of(s - 1), group=self.pipe_group)
            act = self.stages[s](act)
            if s + 1 < self.num_stages and s + 1 not in self.stages:
                dist.send(act.contiguous(), self._rank_of(s + 1), group=self.pipe_group)
        return act if self.holds_last else None

    def _rank_of(self, stage: int) -> int:
        """The world rank running ``stage`` of this replica."""
        return global_rank(self.pipe_group, self.parallel.rank_of_stage(stage))

    def describe(self) -> str:
        """The layout for a log: replicas, schedule, what 'auto' measured, the stages."""
        head = (
            f"pipeline: {self.num_replicas} replica(s) x {self.num_ranks} pipeline ranks, "
            f"{self.num_stages} stages, schedule {self.parallel.schedule}, "
            f"{self.num_microbatches} micro-batches"
        )
        measured = (
            f"\n  split = auto measured: {self.split_measured}" if self.split_measured else ""
        )
        stages = describe_stages(self.stage_of, self.boundaries, self.parallel.rank_of_stage)
        return f"{head}{measured}\n{stages}"


def _example(meta: Boundary) -> torch.Tensor:
    """A meta tensor of a boundary's shape: torch's stages take shapes from it, not a pass."""
    example = torch.empty(meta.shape, dtype=meta.dtype, device="meta")
    # A floating activation that left a stage carries a gradient back (the model's input
    # does not); the stage reads that from requires_grad.
    return example.requires_grad_(meta.src >= 0 and meta.dtype.is_floating_point)


def _mesh_groups(world: Context, num_replicas: int, num_ranks: int) -> tuple[Any, Any]:
    """(data group, pipeline group) of this rank: rank r is replica r // P, stage rank r % P."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        world.device.type, (num_replicas, num_ranks), mesh_dim_names=("data", "pipeline")
    )
    return mesh.get_group("data"), mesh.get_group("pipeline")


@functools.cache
def _notifying_stage_class() -> type:
    """``_NotifyingStage``, defined on first use (pipelining takes ~1.7 s to import)."""
    from torch.distributed.pipelining import PipelineStage

    # Releases before last_backward existed never say which backward is the last: the
    # buckets then launch after the schedule (correct, without overlap).
    takes_last_backward = (
        "last_backward" in inspect.signature(PipelineStage.backward_maybe_with_nosync).parameters
    )

    class _NotifyingStage(PipelineStage):
        """A PipelineStage that tells its owner before each backward whether it is the last."""

        def __init__(self, owner: PipelineParallel, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._owner = owner

        def backward_maybe_with_nosync(
            self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False
        ) -> Any:
            self._owner._listener.before_backward(last_backward)
            self._owner._start_busy()
            # torch's weight-gradient pass assigns or adds to .grad itself, past the hooks.
            params = list(self.submod.parameters()) if backward_type == "weight" else []
            before = [_grad_version(p) for p in params]
            try:
                if takes_last_backward:
                    result = super().backward_maybe_with_nosync(
                        backward_type, bwd_kwargs, last_backward=last_backward
                    )
                else:
                    result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs)
            finally:
                self._owner._stop_busy(kind=str(backward_type))
            if params:
                written = [p for p, v in zip(params, before) if _grad_version(p) != v]
                self._owner._listener.grads_written(written)
            return result

    return _NotifyingStage


def _grad_version(p: nn.Parameter) -> tuple[int, int] | None:
    """What changes when ``p.grad`` is assigned or added to in place."""
    return None if p.grad is None else (id(p.grad), p.grad._version)


def build_pipeline(
    model: nn.Module | list[nn.Module],
    loss_fn: LossFn,
    parallel: ParallelConfig,
    world: Context,
    sample_input: Any,
    stages: list[int] | None,
) -> PipelineParallel:
    """The Engine's entry: ``model`` an ``nn.Sequential`` or list of modules; ``stages``: each
    layer's stage (None: ``parallel.split``); ``sample_input``: one micro-batch of inputs."""
    layers = list(model.children()) if isinstance(model, nn.Module) else list(model)
    if isinstance(model, nn.Module) and not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"parallel.pipeline: a pipeline splits an nn.Sequential or a list of modules, got "
            f"{type(model).__name__}"
        )
    if sample_input is None:
        raise ConfigError(
            "sample_input: a pipeline needs one micro-batch of inputs to trace the activation "
            "shapes that cross stage boundaries"
        )
    check_stage_count(len(layers), parallel.num_stages)
    measured = ""
    if stages is None:
        stages, measured = choose_split(layers, parallel, world, sample_input)
    pipeline = PipelineParallel(layers, stages, parallel, world, sample_input, loss_fn)
    pipeline.split_measured = measured
    return pipeline


def choose_split(
    layers: list[nn.Module], parallel: ParallelConfig, world: Context, sample: Any
) -> tuple[list[int], str]:
    """(stage of each layer, what 'auto' measured), cut on rank 0 and broadcast (measured costs
    differ between processes)."""
    box: list[Any] = [None]
    if world.rank == 0:
        box = [split_here(layers, parallel, sample)]
    dist.broadcast_object_list(box, global_rank(world.group, 0), group=world.group)
    stage_of, text = box[0]
    if world.rank == 0 and text:
        logger.info("phalanx: split = 'auto' chose %s", text)
    return stage_of, text


def split_here(
    layers: list[nn.Module], parallel: ParallelConfig, sample: Any
) -> tuple[list[int], str]:
    """(stage of each layer, what 'auto' measured) in this process: even, or balanced cost."""
    if parallel.split == "even":
        return even_split(len(layers), parallel.num_stages), ""
    costs = profile_layers(layers, sample)
    stage_of = balanced_split([c.seconds for c in costs], parallel.num_stages)
    return stage_of, describe_split(stage_of, costs)


def _standard_strides(x: Any) -> Any:
    """``x`` with row-major strides: torch 2.11's stages compare strides with the traced
    sample's, size-1 dims included (a view's batch is copied once)."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.stride() == torch.empty(x.shape, device="meta").stride():
        return x
    return x.clone(memory_format=torch.contiguous_format)
