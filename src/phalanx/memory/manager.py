"""The memory manager: ``[memory]`` becomes a plan (F17) applied with offload (F18),
recomputation and an optimizer off the device (F19); build's phases are in docs/memory.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from phalanx.costs import LayerCost
from phalanx.fields import ConfigValueError, option, require, require_choice
from phalanx.memory import host_cache, measure
from phalanx.memory.host_mirror import HostMirror
from phalanx.memory.plan import OFFLOAD, RECOMPUTE, Plan, make_plan, predict_peak
from phalanx.memory.residency import OptimizerResidency
from phalanx.memory.stream import OptimizerMirror
from phalanx.memory.tiers import Tier, TierConfig, make_tier, measure_bandwidth

logger = logging.getLogger("phalanx")
OPTIMIZER_PLACES = ("device", "host", "mirror", "stream")
PROFILE_STEPS = 3  # per slice: a warm-up, a timed step and one whose allocator peak is measured
PROFILE_SLICE = 8  # the larger profiled slice is this fraction of the micro-batch (1/8)
# The plan fits the budget less this fraction, for what the byte accounting does not see (the
# allocator's rounding, autograd's bookkeeping, the interpreter): measured 1-4 MiB on the
# models of `phalanx bench memory`, 27 MiB (10% of the peak) on docs/memory.md's example.
PLAN_MARGIN = 0.05
MIN_BANDWIDTH_PROBE = 1 << 20
MAX_BANDWIDTH_PROBE = 32 << 20  # large enough for the transfer rate; it and its read-back
#                                 are held at once, so at most 1/8 of the budget
OPTIMIZER_NOTES = {
    "stream": "optimizer state: in the tier between steps, streamed in chunks of {:g} MiB",
    "mirror": "optimizer: fp32 master parameters, state and arithmetic on the host, streamed "
    "in chunks of {:g} MiB",
}


def _host_memory_note() -> str:
    """What becomes of freed host memory in this process, for the plan's notes."""
    huge = measure.huge_pages_for_large_tensors()
    pages = "tensors of 2 MiB and more in huge pages" if huge else "no huge pages"
    why = host_cache.problem()
    if why is None:
        return (
            "freed host tensors of 64 KiB and more are kept for reuse while the process stays "
            f"under the budget, the rest go back to the OS (host cache, docs/memory.md); {pages}"
        )
    return (
        "freed host memory goes back to the OS, so each step's new tensors fault their pages "
        f"in again: not in the predicted overhead (docs/memory.md measures it); {pages}"
        + ("" if why == "not installed" else f"; no host cache: {why}")
    )


@dataclass(kw_only=True)
class MemoryConfig:
    """Fit a step into less device memory: offload or recompute layers' saved activations."""

    budget_mb: float = option(0.0, "peak memory to fit, MiB (0: no budget, only named layers)")
    offload: list[str] = option(factory=list, doc="layers (by name: '3') whose activations move")
    recompute: list[str] = option(factory=list, doc="layers recomputed in backward (checkpoint)")
    tier: TierConfig = option(factory=TierConfig, doc="where offloaded activations go")
    optimizer: str = option(
        "device",
        "where the optimizer lives (F19): device; mirror (fp32 master parameters, state and "
        "arithmetic on the host, gradients and parameters streamed chunk by chunk); stream "
        "(state in the tier between steps, streamed through the device at each step); host "
        "(mirror on CUDA; stream on a CPU-only machine, whose host is the device)",
    )
    optimizer_chunk_mb: float = option(16.0, "optimizer not on the device: MiB per chunk")
    release_host_memory: bool = option(
        True,
        "return freed host tensors to the OS (glibc's mmap threshold fixed at 64 KiB), so a "
        "CPU run's resident memory falls when tensors are freed and the budget holds for it",
    )
    host_cache: bool = option(
        True,
        "with a budget on a CPU device: keep freed host tensors of 64 KiB and more for reuse "
        "while the process's resident size stays under the budget (a C++ allocator built once "
        "per torch version, docs/memory.md); false, or where it cannot be built: every freed "
        "tensor goes back to the OS and the next step faults fresh pages in",
    )

    def __post_init__(self) -> None:
        require(self.budget_mb >= 0, "budget_mb", f"must be >= 0 MiB, got {self.budget_mb}")
        require_choice(self.optimizer, "optimizer", OPTIMIZER_PLACES)
        chunk = self.optimizer_chunk_mb
        require(chunk > 0, "optimizer_chunk_mb", f"must be > 0 MiB, got {chunk}")
        both = sorted(set(self.offload) & set(self.recompute))
        if both:
            raise ConfigValueError("recompute", f"layer {both[0]!r} is also in memory.offload")

    @property
    def plans_layers(self) -> bool:
        """Whether activations are managed per layer (needs the model as a list of layers)."""
        return bool(self.budget_mb or self.offload or self.recompute)

    @property
    def enabled(self) -> bool:
        return self.plans_layers or self.optimizer != "device"

    @property
    def releases_host_memory(self) -> bool:
        """Whether freed host memory goes back to the OS in this run (``release_host_memory``)."""
        return self.enabled and self.release_host_memory

    def optimizer_place(self, device: torch.device) -> str:
        """``optimizer`` with ``host`` resolved for ``device``: ``mirror`` on CUDA, ``stream``
        where the host is the device (a second copy in the same memory would save nothing)."""
        if self.optimizer != "host":
            return self.optimizer
        return "mirror" if device.type == "cuda" else "stream"


class MemoryManager:
    """The applied plan: recomputation patched into layers, and the offloader (or None)."""

    def __init__(
        self,
        plan: Plan,
        offloader: Any,
        layers: list[nn.Module],
        tier: Tier | None = None,
        optimizer_place: str = "device",
        optimizer_chunk_bytes: int = 0,
        device: torch.device | None = None,
    ) -> None:
        self.plan = plan
        self.offloader = offloader
        self.layers = layers
        self.tier = tier  # open while the offloader or the optimizer stream uses it
        self.optimizer_place = optimizer_place  # device, mirror or stream (host resolved)
        self.optimizer_chunk_bytes = optimizer_chunk_bytes
        self.device = device
        self.mirror: OptimizerResidency | None = None
        for name in plan.layers(RECOMPUTE):
            _recompute(layers[int(name)])

    @classmethod
    def build(
        cls,
        layers: list[nn.Module],
        config: MemoryConfig,
        device: torch.device,
        sample: tuple[torch.Tensor, torch.Tensor] | None = None,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
        optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
        shards: int = 1,
    ) -> MemoryManager:
        """The manager for ``layers`` (in order; [] with only ``optimizer``); a budget needs
        ``sample``, ``loss_fn`` and ``optimizer_factory``; ``shards``: fsdp's ranks."""
        if config.budget_mb and (sample is None or loss_fn is None or optimizer_factory is None):
            raise ValueError("budget_mb: the profile needs sample, loss_fn and optimizer_factory")
        names = [str(i) for i in range(len(layers))]
        for key, given in (("offload", config.offload), ("recompute", config.recompute)):
            unknown = [n for n in given if n not in names]
            if unknown:
                raise ConfigValueError(
                    f"memory.{key}", f"unknown layer {unknown[0]!r}; layers: 0..{len(names) - 1}"
                )
        if config.releases_host_memory:
            measure.release_freed_memory()  # the profile measures the resident set: frees show
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # the run's random streams stay untouched
            notes: list[str] = []
            with host_cache.paused():  # the profile measures what the step itself holds
                costs, fixed, transient = _costs(
                    layers, config, device, sample, loss_fn, optimizer_factory, notes, shards
                )
            # Phase 2: the tier and its measured bandwidth.
            tier = make_tier(config.tier, device)
            probe = _probe_bytes(costs, config.budget_mb)
            write, read = measure_bandwidth(tier, probe)
        # Phase 3: the plan.
        try:
            plan = make_plan(
                costs,
                fixed,
                int(config.budget_mb * 2**20) or None,
                write_bytes_per_s=write,
                read_bytes_per_s=read,
                offload=config.offload,
                recompute=config.recompute,
                offload_overhead_bytes=tier.overhead_bytes,
                margin=PLAN_MARGIN,
            )
        except BaseException:
            tier.close()  # no plan, nothing uses it: its thread and file go now
            raise
        if config.budget_mb:
            notes.append(
                f"planned to {100 * (1 - PLAN_MARGIN):.0f}% of the budget: a margin for what "
                "the accounting does not see (docs/memory.md)"
            )
        if config.releases_host_memory and device.type == "cpu":
            notes.append(_host_memory_note())
        plan.notes += notes
        plan.notes.append(
            f"tier {type(tier).__name__}: write {write / 1e9:.2f} GB/s, read {read / 1e9:.2f} GB/s"
        )
        if transient:
            plan.notes.append(
                f"kernels' workspaces and temporaries beyond the saved tensors: "
                f"{transient / 2**20:.1f} MiB (the profiled steps' measured peak), in every peak"
            )
        # Phase 4: apply.
        offloaded = [int(name) for name in plan.layers(OFFLOAD)]
        offloader = None
        if offloaded:
            from phalanx.memory.offload import ActivationOffloader

            # Forward holds at most one layer's writes in flight besides the layer computing:
            # the plan's window (the two largest offloaded layers) then covers forward too.
            largest = max(costs[i].saved_bytes for i in offloaded)
            window = {"max_inflight_bytes": largest} if largest > 0 else {}
            offloader = ActivationOffloader(
                layers, offloaded, tier, prefetch_bytes=plan.prefetch_bytes, **window
            )
        place = config.optimizer_place(device)
        chunk_bytes = int(config.optimizer_chunk_mb * 2**20)
        if place != "device":
            plan.notes.append(OPTIMIZER_NOTES[place].format(config.optimizer_chunk_mb))
        if not offloaded and place != "stream":  # nothing uses the tier
            tier.close()
        used = tier if offloaded or place == "stream" else None
        return cls(plan, offloader, layers, used, place, chunk_bytes, device)

    def attach_optimizer(
        self, optimizer: torch.optim.Optimizer, module: nn.Module | None = None
    ) -> OptimizerResidency | None:
        """Take over the optimizer the Engine's strategy built, as ``[memory] optimizer`` says:
        ``stream`` keeps its state in the tier, ``mirror`` steps it on the host (``module``:
        the model, whose forward pre-hooks then wait for each layer's updated parameters)."""
        assert self.mirror is None
        if self.optimizer_place == "stream":
            assert self.tier is not None
            self.mirror = OptimizerMirror(optimizer, self.tier, self.optimizer_chunk_bytes)
        elif self.optimizer_place == "mirror":
            assert self.device is not None
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if self.device.type != "cpu" and params and all(p.is_cpu for p in params):
                # ps servers keep fp32 masters and their state on the host and step there
                # already (its pulls copy them back): nothing to mirror.
                return None
            self.mirror = HostMirror(optimizer, self.device, module, self.optimizer_chunk_bytes)
        return self.mirror

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one step's forward and backward (every micro-batch)."""
        if self.offloader is None:
            yield
            return
        with self.offloader.step():
            yield

    def describe(self) -> str:
        return "\n".join([self.plan.describe(), *(f"  {n}" for n in self.plan.notes)])

    def discard_optimizer_state(self) -> None:
        """At ``close``, drop an optimizer state kept in the tier instead of bringing it back
        (the run is over and checkpointed); no-op for the host mirror and without a mirror."""
        if isinstance(self.mirror, OptimizerMirror):
            self.mirror.discard_state()

    def close(self) -> None:
        if self.mirror is not None:
            self.mirror.close()
        if self.offloader is not None:
            self.offloader.close()  # closes the tier too
            self.offloader = None
        elif self.tier is not None:
            self.tier.close()
        self.tier = None


def _costs(
    layers: list[nn.Module],
    config: MemoryConfig,
    device: torch.device,
    sample: Any,
    loss_fn: Any,
    optimizer_factory: Any,
    notes: list[str],
    shards: int = 1,
) -> tuple[list[LayerCost], int, int]:
    """Phase 1 (docs/memory.md): per-layer costs of the full micro-batch (zero without a
    budget), the bytes every plan holds above the start, and of those the transient bytes."""
    if not config.budget_mb:
        return [LayerCost(name=str(i)) for i in range(len(layers))], 0, 0
    x, y = sample
    full = int(x.shape[0]) if x.dim() else 1
    sizes = _slice_sizes(full)
    measure.trim()
    start = measure.current_bytes(device)
    fits = [_slice_costs(layers, loss_fn, (x[:n], y[:n]), device) for n in sizes]
    state = _optimizer_state_bytes(layers, optimizer_factory, notes)
    measure.trim()
    # What the first steps add to the process for good (libraries' code pages and the modules
    # an optimizer's first step imports, kernel caches, threads' arenas): measured, and held
    # by every plan.
    retained = max(0, measure.current_bytes(device) - start)
    costs = [_extrapolate(a, b, sizes, full) for a, b in zip(fits[0][0], fits[-1][0])]
    transient = max(0, round(_line(fits[0][1], fits[-1][1], sizes, full)))
    grads = _grad_bytes(layers)
    if shards > 1:
        grads, state = _sharded(layers, grads, state, shards, notes)
    moving = _moving(costs)
    notes.append(
        f"the process's own growth in its first steps (code, caches, arenas): "
        f"{retained / 2**20:.1f} MiB, in every peak"
    )
    if len(sizes) > 1:
        notes.append(
            f"profiled on {sizes[0]} and {sizes[1]} of {full} samples, extrapolated (the "
            "profile stays within the budget; no copy of the model)"
        )
    return costs, grads + state + moving + transient + retained, transient


def _sharded(
    layers: list[nn.Module], grads: int, state: int, shards: int, notes: list[str]
) -> tuple[int, int]:
    """(gradient bytes, state bytes) a rank holds when both are sharded over ``shards`` ranks
    (fsdp): its share of each, plus the largest layer's whole gradient before its
    reduce-scatter and the gathered parameters of the running and the prefetched layer."""
    largest = max((_grad_bytes([layer]) for layer in layers), default=0)
    notes.append(
        f"gradients and optimizer state sharded over {shards} ranks; the largest layer's "
        f"gathered parameters and whole gradient ({largest / 2**20:.1f} MiB) counted 3 times"
    )
    return grads // shards + 3 * largest, state // shards


def _moving(costs: list[LayerCost]) -> int:
    """Backward's gradients in flight where the layers' backward work was not measured: the
    gradient arriving at a layer and the one it produces live together."""
    if any(cost.backward_work_bytes for cost in costs):
        return 0  # the plan counts them per layer
    return max(cost.input_bytes + cost.output_bytes for cost in costs)


def _probe_bytes(costs: list[LayerCost], budget_mb: float) -> int:
    """The bandwidth probe: the largest layer's saved bytes, within the probe's bounds."""
    largest = max((c.saved_bytes for c in costs), default=0)
    cap = MAX_BANDWIDTH_PROBE if not budget_mb else min(MAX_BANDWIDTH_PROBE, budget_mb * 2**17)
    return int(max(MIN_BANDWIDTH_PROBE, min(largest, cap)))


def _slice_sizes(full: int) -> list[int]:
    """The two slices the profile runs (one for a micro-batch of one sample)."""
    if full < 2:
        return [full]
    large = min(full, max(2, full // PROFILE_SLICE))
    return [max(1, large // 2), large]


def _slice_costs(
    layers: list[nn.Module], loss_fn: Any, batch: Any, device: torch.device
) -> tuple[list[LayerCost], float]:
    """The layers' costs on one slice, and the step's ``measure.StepPeak`` there beyond what
    the costs account for."""
    from phalanx.memory.profile import profile_model

    buffers = [(b, b.detach().clone()) for layer in layers for b in layer.buffers()]
    try:
        steps = [batch] * (PROFILE_STEPS - 1)
        profile = profile_model(layers, loss_fn, None, steps, device, warmup=1, measure_peak=False)
        measure.trim()
        meter = measure.StepPeak(device)
        worked = profile_model(
            layers, loss_fn, None, [batch], device, measure_peak=False, measure_work=True
        )
        peak = meter.peak_bytes()
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    x = batch[0]
    work = [layer.backward_work_bytes for layer in worked.layers]
    costs = [
        replace(cost, backward_work_bytes=w)
        for cost, w in zip(profile.layer_costs(input_bytes=x.numel() * x.element_size()), work)
    ]
    return costs, float(peak - predict_peak(costs, {}, _grad_bytes(layers) + _moving(costs)))


def _line(small: float, large: float, sizes: list[int], full: int) -> float:
    """The value at ``full`` samples on the line through the two slices' values (never below
    the larger slice's: a value that shrinks with the batch is noise)."""
    if len(sizes) == 1:
        return large * full / sizes[0]
    slope = max(0.0, (large - small) / (sizes[1] - sizes[0]))
    return large + slope * (full - sizes[1])


def _extrapolate(small: LayerCost, large: LayerCost, sizes: list[int], full: int) -> LayerCost:
    def line(key: str) -> float:
        return _line(getattr(small, key), getattr(large, key), sizes, full)

    return replace(
        large,
        backward_work_bytes=round(line("backward_work_bytes")),
        forward_s=line("forward_s"),
        backward_s=line("backward_s"),
        saved_bytes=round(line("saved_bytes")),
        output_bytes=round(line("output_bytes")),
        input_bytes=round(line("input_bytes")),
    )


def _trainable(layers: list[nn.Module]) -> list[nn.Parameter]:
    seen = {id(p): p for layer in layers for p in layer.parameters() if p.requires_grad}
    return list(seen.values())


def _grad_bytes(layers: list[nn.Module]) -> int:
    return sum(p.numel() * p.element_size() for p in _trainable(layers))


def _optimizer_state_bytes(layers: list[nn.Module], factory: Any, notes: list[str]) -> int:
    """The optimizer's state after a step over tiny stand-ins (each dimension 2), scaled to the
    parameters; Adam's 2x where it cannot step. (Meta tensors would import 70 MiB of torch's
    decompositions into the process the budget is measured on.)"""
    params = _trainable(layers)
    stand_ins = [nn.Parameter(torch.zeros((2,) * p.dim(), dtype=p.dtype)) for p in params]
    for p in stand_ins:
        p.grad = torch.ones_like(p)
    try:
        optimizer = factory(stand_ins)
        optimizer.step()
    except Exception as e:  # any optimizer may refuse the stand-ins: the estimate stands in
        notes.append(
            f"optimizer state counted as 2x the parameters (its step on stand-ins failed: "
            f"{type(e).__name__})"
        )
        return 2 * _grad_bytes(layers)
    total = 0
    for param, stand_in in zip(params, stand_ins):
        for t in optimizer.state.get(stand_in, {}).values():
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                total += t.element_size() if isinstance(t, torch.Tensor) else 0
            else:
                total += t.numel() * param.numel() // stand_in.numel() * t.element_size()
    return total


def _recompute(layer: nn.Module) -> None:
    """Run ``layer`` under torch.utils.checkpoint; the instance's forward is wrapped, so names
    and state dicts stay as they were."""
    from torch.utils.checkpoint import checkpoint

    forward = layer.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = checkpointed
