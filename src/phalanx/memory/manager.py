"""The memory manager: ``[memory]`` turns into a plan (F17) applied with offload (F18) and
recomputation around the Engine's forward and backward.

    manager = MemoryManager.build(layers, MemoryConfig(budget_mb=300), device, sample, loss_fn,
                                  optimizer_factory)
    print(manager.plan.describe())
    engine = px.Engine(model, loss_fn, optimizer_factory, memory=manager)

Phases of ``build``:
  Phase 1 (profile, only with a budget): a copy of the layers trains three steps on the sample
    batch under the one per-layer profiler (phalanx.memory.profile), whose ``layer_costs`` the
    plan reads; the real model is not touched.
  Phase 2 (tier): the next tier is opened (pinned host memory on CUDA, a spill file on CPU) and
    its write/read bandwidth measured with a transfer the size of the largest layer's saved
    tensors.
  Phase 3 (plan): keep / offload / recompute per layer, the named layers first, the budget's
    choices by least predicted time per byte.
  Phase 4 (apply): recomputed layers run under torch.utils.checkpoint (their module and
    parameter names do not change); offloaded layers get an ActivationOffloader, whose
    ``step()`` the Engine enters around forward and backward.
  Phase 5 (optimizer, unless ``optimizer = "device"``): the Engine hands over the optimizer its
    strategy built (``attach_optimizer``): a HostMirror steps fp32 masters on the host
    (``mirror``, phalanx.memory.host_mirror), an OptimizerMirror keeps its state in the tier
    between steps (``stream``, phalanx.memory.mirror); ``host`` is the first on CUDA, the
    second on a CPU-only machine.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from phalanx.costs import LayerCost
from phalanx.fields import ConfigValueError, option, require
from phalanx.memory.host_mirror import HostMirror
from phalanx.memory.mirror import OptimizerMirror
from phalanx.memory.plan import OFFLOAD, RECOMPUTE, Plan, make_plan, predict_peak
from phalanx.memory.residency import OptimizerResidency
from phalanx.memory.tiers import Tier, TierConfig, make_tier, measure_bandwidth

logger = logging.getLogger("phalanx")
OPTIMIZER_PLACES = ("device", "host", "mirror", "stream")
PROFILE_STEPS = 3  # a warm-up, a timed step and one whose allocator peak is measured
MIN_BANDWIDTH_PROBE = 1 << 20
OPTIMIZER_NOTES = {
    "stream": "optimizer state: in the tier between steps, streamed in chunks of {:g} MiB",
    "mirror": "optimizer: fp32 master parameters, state and arithmetic on the host, streamed "
    "in chunks of {:g} MiB",
}


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

    def __post_init__(self) -> None:
        require(self.budget_mb >= 0, "budget_mb", f"must be >= 0 MiB, got {self.budget_mb}")
        require(
            self.optimizer in OPTIMIZER_PLACES,
            "optimizer",
            f"got {self.optimizer!r}; allowed: {', '.join(OPTIMIZER_PLACES)}",
        )
        require(
            self.optimizer_chunk_mb > 0,
            "optimizer_chunk_mb",
            f"must be > 0 MiB, got {self.optimizer_chunk_mb}",
        )
        both = sorted(set(self.offload) & set(self.recompute))
        require(
            not both, "recompute", f"layer {both[0]!r} is also in memory.offload" if both else ""
        )

    @property
    def plans_layers(self) -> bool:
        """Whether activations are managed per layer (needs the model as a list of layers)."""
        return bool(self.budget_mb or self.offload or self.recompute)

    @property
    def enabled(self) -> bool:
        return self.plans_layers or self.optimizer != "device"

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
    ) -> MemoryManager:
        """The manager for ``layers`` (the model's, in order; [] with only ``optimizer =
        "host"``). ``sample`` (one micro-batch), ``loss_fn`` and ``optimizer_factory`` are
        needed with a budget, which profiles a copy of the layers."""
        if config.budget_mb and (sample is None or loss_fn is None or optimizer_factory is None):
            raise ValueError("budget_mb: the profile needs sample, loss_fn and optimizer_factory")
        names = [str(i) for i in range(len(layers))]
        for key, given in (("offload", config.offload), ("recompute", config.recompute)):
            unknown = [n for n in given if n not in names]
            if unknown:
                raise ConfigValueError(
                    f"memory.{key}", f"unknown layer {unknown[0]!r}; layers: 0..{len(names) - 1}"
                )
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # the run's random streams stay untouched
            costs, fixed, transient = _costs(
                layers, config, device, sample, loss_fn, optimizer_factory
            )
            # Phase 2: the tier and its measured bandwidth.
            tier = make_tier(config.tier, device)
            probe = max(MIN_BANDWIDTH_PROBE, max((c.saved_bytes for c in costs), default=0))
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
            )
        except BaseException:
            tier.close()  # no plan, nothing uses it: its thread and file go now
            raise
        plan.notes.append(
            f"tier {type(tier).__name__}: write {write / 1e9:.2f} GB/s, read {read / 1e9:.2f} GB/s"
        )
        if transient:
            plan.notes.append(
                f"kernels' workspaces and temporaries beyond the saved tensors: "
                f"{transient / 2**20:.1f} MiB (the profiled step's allocator peak), in every peak"
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
        optimizer: dict[str, Any] = {"optimizer_place": place, "optimizer_chunk_bytes": chunk_bytes}
        if not offloaded and place != "stream":  # nothing uses the tier
            tier.close()
            return cls(plan, offloader, layers, None, **optimizer, device=device)
        return cls(plan, offloader, layers, tier, **optimizer, device=device)

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
) -> tuple[list[LayerCost], int, int]:
    """Phase 1: per-layer costs from a profile of a copy of the layers (with a budget), or
    zero costs when only named layers are managed (nothing to choose); the fixed bytes every
    plan holds; and of those, the transient bytes the profiled step's allocator peak showed
    beyond the accounted tensors (kernels' workspaces, autograd's temporaries)."""
    if not config.budget_mb:
        return [LayerCost(name=str(i)) for i in range(len(layers))], 0, 0
    from phalanx.memory.profile import profile_model

    copies = copy.deepcopy(layers)
    profile = profile_model(
        copies, loss_fn, optimizer_factory, [sample] * PROFILE_STEPS, device, warmup=1
    )
    costs = profile.layer_costs(input_bytes=sample[0].numel() * sample[0].element_size())
    fixed = sum(
        layer.param_bytes + layer.buffer_bytes + layer.grad_bytes + layer.optimizer_bytes
        for layer in profile.layers
    )
    # In backward the gradient arriving at a layer and the one it produces live together.
    fixed += max(cost.input_bytes + cost.output_bytes for cost in costs)
    # What the accounting cannot see, measured: the unmanaged step's true peak above its
    # prediction, held as a margin by every plan (the workspace recurs whatever is offloaded).
    transient = 0
    if profile.measured_peak_bytes is not None:
        transient = max(0, profile.measured_peak_bytes - predict_peak(costs, {}, fixed))
    del copies
    return costs, fixed + transient, transient


def _recompute(layer: nn.Module) -> None:
    """Run ``layer`` under torch.utils.checkpoint from now on: only its input is saved, its
    forward runs again in backward. The instance's forward is wrapped, so module and parameter
    names (and state dicts) stay as they were."""
    from torch.utils.checkpoint import checkpoint

    forward = layer.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = checkpointed
