"""The profile of one training step on one device: what the simulator replays. ``layers`` are in
backward order, each with forward and backward seconds and the gradient bytes ready when its
backward ends. Sources: ``from_backward_profile``, ``from_memory_profile``, ``synthesize``;
the JSON form is what ``phalanx plan --profile`` reads (docs/planner.md, "Inputs")."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from phalanx.costs import LayerCost
from phalanx.errors import ConfigError
from phalanx.exchange.threshold import BackwardProfile
from phalanx.fileio import atomic_write_text

FORMAT = "phalanx.step/1"
BYTES_PER_PARAM = 4  # float32 gradients
BACKWARD_PER_FORWARD = 2.0  # backward computes two products per forward one (input and weights)


@dataclass(kw_only=True)
class StepProfile:
    """One step of one device: layers in backward order, optimizer, batch, input."""

    layers: list[LayerCost]
    batch_size: int
    optimizer_s_per_byte: float = 0.0  # optimizer seconds per gradient byte it updates
    input_s: float = 0.0  # per-step input wait that the input pipeline does not hide
    engine_s: float = 0.0  # per-step work of the training loop itself (bucket bookkeeping, checks)
    source: str = ""  # where the numbers come from
    meta: dict[str, Any] = field(default_factory=dict)
    # per exchange strategy, the run's own Engine at world 1 (``build.engine_phases``): what
    # ``for_strategy`` calibrates the totals to (fsdp's world-1 step copies every unit in and
    # out; ps serves on its thread); empty: the layers' own totals for every strategy
    strategy_phases: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ConfigError("step profile: needs at least one layer")
        if self.batch_size < 1:
            raise ConfigError(f"step profile: batch_size must be >= 1, got {self.batch_size}")
        if min(self.optimizer_s_per_byte, self.input_s, self.engine_s) < 0:
            raise ConfigError(
                "step profile: optimizer_s_per_byte, input_s and engine_s must be >= 0"
            )

    # -- totals --------------------------------------------------------------------------------
    @property
    def forward_s(self) -> float:
        return sum(layer.forward_s for layer in self.layers)

    @property
    def backward_s(self) -> float:
        return sum(layer.backward_s for layer in self.layers)

    @property
    def grad_sizes(self) -> list[int]:
        """Every gradient's bytes, in the order they become ready."""
        return [n for layer in self.layers for n in layer.grad_bytes]

    @property
    def total_grad_bytes(self) -> int:
        return sum(self.grad_sizes)

    @property
    def optimizer_s(self) -> float:
        """The optimizer's time over every gradient (one device, nothing sharded)."""
        return self.optimizer_s_per_byte * self.total_grad_bytes

    @property
    def compute_s(self) -> float:
        """The step on one device: input wait, the loop's own work, forward, backward and
        optimizer, no exchange."""
        return self.input_s + self.engine_s + self.forward_s + self.backward_s + self.optimizer_s

    def scaled(self, speed: float) -> StepProfile:
        """The same step on a device ``speed`` times faster (compute and optimizer only)."""
        if speed == 1.0:
            return self
        layers = [
            replace(layer, forward_s=layer.forward_s / speed, backward_s=layer.backward_s / speed)
            for layer in self.layers
        ]
        return replace(self, layers=layers, optimizer_s_per_byte=self.optimizer_s_per_byte / speed)

    # -- constructors --------------------------------------------------------------------------
    @classmethod
    def from_backward_profile(
        cls,
        profile: Any,
        *,
        forward_s: float,
        batch_size: int,
        optimizer_s: float = 0.0,
        input_s: float = 0.0,
        source: str = "backward profile",
    ) -> StepProfile:
        """From a measured ``BackwardProfile``: its ``layer_costs`` (each gradient a layer),
        with the forward time, which that profile does not measure."""
        layers = profile.layer_costs(forward_s)
        total = max(1, sum(profile.nbytes))
        return cls(
            layers=layers,
            batch_size=batch_size,
            optimizer_s_per_byte=optimizer_s / total,
            input_s=input_s,
            source=source,
        )

    @classmethod
    def from_memory_profile(cls, profile: Any, source: str = "phalanx profile") -> StepProfile:
        """From ``phalanx profile``'s MemoryProfile: its ``layer_costs`` reversed, each layer's
        gradients one tensor; the loss's backward first, its forward joins the last layer's."""
        layers = [
            LayerCost(
                name="loss", forward_s=profile.loss_forward_s, backward_s=profile.loss_backward_s
            )
        ]
        for layer, cost in zip(reversed(profile.layers), reversed(profile.layer_costs())):
            layers.append(replace(cost, name=f"{cost.name} ({layer.type})"))
        total = max(1, sum(layer.grad_bytes for layer in profile.layers))
        return cls(
            layers=layers,
            batch_size=profile.batch_size,
            optimizer_s_per_byte=profile.optimizer_s / total,
            input_s=profile.input_wait_s,
            source=f"{source} on {profile.device}",
            meta={"timed_steps": len(profile.step_s), "step_spread": profile.spread},
        )

    def calibrated(self, phases: dict[str, float]) -> StepProfile:
        """This profile with its totals set to the run's own Engine's at world 1: forward and
        backward scaled per pass (the split between layers kept), the optimizer's seconds per
        byte, ``engine_s`` the loop's time outside its phases."""
        forward = phases["forward"] / self.forward_s if self.forward_s > 0 else 1.0
        backward = phases["backward"] / self.backward_s if self.backward_s > 0 else 1.0
        layers = [
            replace(layer, forward_s=layer.forward_s * forward,
                    backward_s=layer.backward_s * backward)
            for layer in self.layers
        ]  # fmt: skip
        inside = phases["forward"] + phases["backward"] + phases["optimizer"] + self.input_s
        return replace(
            self,
            layers=layers,
            optimizer_s_per_byte=phases["optimizer"] / max(1, self.total_grad_bytes),
            engine_s=max(0.0, phases["loop"] - inside),
            source=f"{self.source}, totals from the run's Engine",
            meta={**self.meta, "engine_phases": dict(phases)},
        )

    def for_strategy(self, strategy: str | None) -> StepProfile:
        """This step as ``strategy``'s Engine runs it at world 1, where that was measured."""
        phases = self.strategy_phases.get(strategy or "")
        return self if phases is None else self.calibrated(phases)

    @property
    def spread(self) -> float | None:
        """The profiled steps' IQR over their median (``phalanx profile``; None: not known)."""
        value = self.meta.get("step_spread")
        return None if value is None else float(value)

    @classmethod
    def synthesize(
        cls,
        *,
        samples_per_s: float,
        batch_size: int,
        layer_params: Sequence[float] | None = None,
        num_params: float | None = None,
        num_layers: int | None = None,
        layer_compute: Sequence[float] | None = None,
        layer_names: Sequence[str] | None = None,
        backward_per_forward: float = BACKWARD_PER_FORWARD,
        optimizer_s_per_byte: float = 0.0,
        bytes_per_param: int = BYTES_PER_PARAM,
        source: str = "synthesised",
    ) -> StepProfile:
        """A step from published figures: per-device ``samples_per_s`` at ``batch_size`` gives
        the step's time; the optimizer takes ``optimizer_s_per_byte`` x gradient bytes of it
        and the rest is forward + backward, backward = ``backward_per_forward`` x forward.

        Layers are given in *forward* order (as papers list them): either ``layer_params``
        (parameters per layer) or ``num_params`` spread evenly over ``num_layers``. Compute is
        spread in proportion to ``layer_compute`` (e.g. multiply-adds per layer) or evenly."""
        if samples_per_s <= 0 or batch_size < 1:
            raise ConfigError("synthesize: samples_per_s must be > 0 and batch_size >= 1")
        if layer_params is None:
            if not num_params or not num_layers or num_layers < 1:
                raise ConfigError("synthesize: give layer_params, or num_params and num_layers")
            layer_params = [num_params / num_layers] * num_layers
        weights = list(layer_compute) if layer_compute is not None else [1.0] * len(layer_params)
        if len(weights) != len(layer_params) or sum(weights) <= 0:
            raise ConfigError("synthesize: layer_compute needs one weight per layer, sum > 0")
        names = list(layer_names) if layer_names is not None else []
        names += [f"layer{i}" for i in range(len(names), len(layer_params))]
        grads = [(int(round(p * bytes_per_param)),) if p > 0 else () for p in layer_params]
        total_bytes = sum(sum(g) for g in grads)
        step_s = batch_size / samples_per_s
        optimizer_s = optimizer_s_per_byte * total_bytes
        if optimizer_s >= step_s:
            raise ConfigError("synthesize: the optimizer alone takes longer than the step")
        forward_total = (step_s - optimizer_s) / (1.0 + backward_per_forward)
        total_weight = sum(weights)
        forward_layers = [
            LayerCost(
                name=name,
                forward_s=forward_total * w / total_weight,
                backward_s=forward_total * backward_per_forward * w / total_weight,
                grad_bytes=g,
            )
            for name, g, w in zip(names, grads, weights)
        ]
        return cls(
            layers=list(reversed(forward_layers)),
            batch_size=batch_size,
            optimizer_s_per_byte=optimizer_s_per_byte,
            source=source,
        )

    # -- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "source": self.source,
            "batch_size": self.batch_size,
            "optimizer_s_per_byte": self.optimizer_s_per_byte,
            "input_s": self.input_s,
            "engine_s": self.engine_s,
            "meta": self.meta,
            "strategy_phases": self.strategy_phases,
            "layers": [
                {
                    "name": layer.name,
                    "forward_s": layer.forward_s,
                    "backward_s": layer.backward_s,
                    "grad_bytes": list(layer.grad_bytes),
                }
                for layer in self.layers
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepProfile:
        try:
            layers = [
                LayerCost(
                    name=str(x["name"]),
                    forward_s=float(x["forward_s"]),
                    backward_s=float(x["backward_s"]),
                    grad_bytes=tuple(int(n) for n in x.get("grad_bytes", ())),
                )
                for x in data["layers"]
            ]
            return cls(
                layers=layers,
                batch_size=int(data["batch_size"]),
                optimizer_s_per_byte=float(data.get("optimizer_s_per_byte", 0.0)),
                input_s=float(data.get("input_s", 0.0)),
                engine_s=float(data.get("engine_s", 0.0)),
                strategy_phases={
                    str(k): {str(n): float(x) for n, x in v.items()}
                    for k, v in dict(data.get("strategy_phases", {})).items()
                },
                source=str(data.get("source", "")),
                meta=dict(data.get("meta", {})),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ConfigError):  # a layer's own check: say where it came from
                message = str(e)
                prefix = "" if message.startswith("step profile") else "step profile: "
                raise ConfigError(prefix + message) from None
            raise ConfigError(
                f"step profile: missing or bad field ({type(e).__name__}: {e})"
            ) from None

    def save(self, path: Path | str) -> Path:
        """Write as JSON atomically; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")
        return path


def load_step_profile(path: Path | str, forward_s: float | None = None) -> StepProfile:
    """Read a step profile JSON: a StepProfile (``save``), a MemoryProfile (``phalanx profile
    --json``) or a BackwardProfile (``to_dict``; its forward time is ``forward_s``, default half
    its backward time). One-line ConfigError naming the file otherwise."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read a step profile ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a step profile (expected a JSON object)")
    try:
        if data.get("format") == FORMAT:
            return StepProfile.from_dict(data)
        if "timeline" in data and "layers" in data:
            from phalanx.memory.profile import MemoryProfile

            return StepProfile.from_memory_profile(MemoryProfile.from_dict(data))
        if "ready_s" in data:
            backward = BackwardProfile.from_dict(data)
            forward = backward.backward_s / BACKWARD_PER_FORWARD if forward_s is None else forward_s
            return StepProfile.from_backward_profile(
                backward, forward_s=forward, batch_size=int(data.get("batch_size", 1))
            )
    except (ConfigError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    raise ConfigError(
        f"{path}: not a step profile: expected the JSON of a StepProfile, of `phalanx profile "
        "--json` or of a BackwardProfile"
    )


def measure_step_profile(
    config: Any,
    steps: int | None = None,
    device: str = "auto",
    strategies: tuple[str, ...] | list[str] = (),
) -> StepProfile:
    """A run config's step on this process: the per-layer profile (``steps`` None: until
    stable), its totals set to the run's own Engine's at world 1 (a pipeline config keeps the
    per-layer totals). ``strategies``: also each one's Engine at world 1 (``for_strategy``)."""
    from phalanx.build import engine_phases, profile_run

    profile = StepProfile.from_memory_profile(profile_run(config, steps=steps, device=device))
    if config.parallel.enabled:
        return profile
    own = config.exchange.strategy
    names = list(dict.fromkeys([own, *strategies]))
    configs = [
        config if name == own
        else replace(config, exchange=replace(config.exchange, strategy=name, options={}))
        for name in names
    ]  # fmt: skip
    measured = dict(zip(names, engine_phases(configs, device)))
    return replace(profile.calibrated(measured[own]), strategy_phases=measured)
