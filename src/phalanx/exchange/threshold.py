"""The fusion threshold (F12) from measurements: backward profile x link model -> bucket bytes.

Layers (``phalanx.costs.LayerCost``, from ``memory/profile.py`` or ``BackwardRecorder``) are
replayed through ``buckets.plan_buckets`` for each candidate threshold; the least predicted
exposed exchange wins, ties to the larger. Model and closed form: docs/exchange.md, "The fusion
threshold (F12)".
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phalanx.costs import LayerCost
from phalanx.errors import ConfigError
from phalanx.exchange.buckets import FIRST_BUCKET_BYTES, plan_buckets
from phalanx.exchange.link import (
    LinkModel,
    broadcast_from_rank0,
    ring_bandwidth_factor,
    ring_latency_factor,
)

REFERENCE_BYTES = 25 * 2**20  # the usual fixed threshold (DDP's and phalanx's default)
CANDIDATES_PER_OCTAVE = 4
TIE_RELATIVE = 0.01  # predictions this close are not told apart (the inputs are noisy medians)
TIE_ABSOLUTE_S = 1e-6


@dataclass(frozen=True)
class BackwardProfile:
    """When each gradient became ready in backward (ascending), its bytes and parameter."""

    ready_s: tuple[float, ...]
    nbytes: tuple[int, ...]
    backward_s: float
    param_indices: tuple[int, ...] = ()
    num_steps: int = 1

    def __post_init__(self) -> None:
        num = len(self.ready_s)
        if num == 0 or len(self.nbytes) != num:
            raise ValueError("backward profile: needs one ready time and one size per gradient")
        if self.param_indices and len(self.param_indices) != num:
            raise ValueError("backward profile: param_indices must have one index per gradient")
        if not all(a <= b for a, b in zip(self.ready_s, self.ready_s[1:])):
            raise ValueError("backward profile: ready times must be in ascending order")
        if self.ready_s[0] < 0 or self.ready_s[-1] > self.backward_s:
            raise ValueError("backward profile: ready times must lie within [0, backward_s]")
        if min(self.nbytes) < 0:
            raise ValueError("backward profile: sizes must be >= 0 bytes")

    @property
    def num_layers(self) -> int:
        return len(self.nbytes)

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes)

    @property
    def bytes_per_layer(self) -> float:
        return self.total_bytes / self.num_layers

    @classmethod
    def uniform(cls, total_bytes: int, num_layers: int, backward_s: float) -> BackwardProfile:
        """L equal layers whose gradients arrive at an even pace: layer i at (i+1)/L * E_b."""
        sizes = [total_bytes // num_layers] * num_layers
        sizes[-1] += total_bytes - sum(sizes)
        ready = tuple(min(backward_s, backward_s * (i + 1) / num_layers) for i in range(num_layers))
        return cls(ready_s=ready, nbytes=tuple(sizes), backward_s=backward_s)

    @classmethod
    def from_layers(cls, layers: Sequence[LayerCost]) -> BackwardProfile:
        """Layers in backward order: each gradient is ready when its layer's backward ends."""
        ready, sizes, clock = [], [], 0.0
        for layer in layers:
            clock += layer.backward_s
            for n in layer.grad_bytes:
                ready.append(clock)
                sizes.append(n)
        if not sizes:
            raise ConfigError("backward profile: no layer has gradients: nothing to exchange")
        return cls(ready_s=tuple(ready), nbytes=tuple(sizes), backward_s=max(clock, ready[-1]))

    def layer_costs(self, forward_s: float = 0.0) -> list[LayerCost]:
        """One ``LayerCost`` per gradient, then a tail; ``forward_s`` split as backward's."""
        layers, previous = [], 0.0
        backward_total = max(self.backward_s, 1e-12)
        for index, ready, nbytes in zip(_indices(self), self.ready_s, self.nbytes):
            backward = max(0.0, ready - previous)
            previous = max(previous, ready)
            layers.append(
                LayerCost(
                    name=f"grad{index}",
                    forward_s=forward_s * backward / backward_total,
                    backward_s=backward,
                    grad_bytes=(int(nbytes),),
                )
            )
        tail = max(0.0, self.backward_s - previous)
        if tail > 0:
            layers.append(
                LayerCost(name="tail", forward_s=forward_s * tail / backward_total, backward_s=tail)
            )
        return layers

    def to_dict(self) -> dict[str, Any]:
        return {
            "backward_s": self.backward_s,
            "num_steps": self.num_steps,
            "num_layers": self.num_layers,
            "total_bytes": self.total_bytes,
            "ready_s": list(self.ready_s),
            "nbytes": list(self.nbytes),
            "param_indices": list(self.param_indices),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BackwardProfile:
        return cls(
            ready_s=tuple(map(float, data["ready_s"])),
            nbytes=tuple(map(int, data["nbytes"])),
            backward_s=float(data["backward_s"]),
            param_indices=tuple(map(int, data.get("param_indices", ()))),
            num_steps=int(data.get("num_steps", 1)),
        )


class BackwardRecorder:
    """Records the first steps' backward profile (``start``, ``record`` from the hook, ``stop``)."""

    def __init__(
        self,
        num_steps: int = 3,
        skip_steps: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if num_steps < 1 or skip_steps < 0:
            raise ValueError(
                f"BackwardRecorder: num_steps >= 1 and skip_steps >= 0, got {num_steps}, "
                f"{skip_steps}"
            )
        self.num_steps = num_steps
        self.skip_steps = skip_steps
        self._clock = clock
        self._start: float | None = None
        self._events: dict[int, tuple[float, int]] = {}
        self._order: dict[int, int] = {}  # param index -> first position seen (tie-break)
        self._steps: list[tuple[dict[int, tuple[float, int]], float]] = []
        self._num_stopped = 0

    @property
    def done(self) -> bool:
        return len(self._steps) >= self.num_steps

    def start(self) -> None:
        if self.done:
            return
        self._events = {}
        self._start = self._clock()

    def record(self, param_index: int, nbytes: int) -> None:
        """Called by the hook as gradient ``param_index`` (of ``nbytes`` bytes) is ready."""
        if self._start is None:
            return
        self._events[param_index] = (self._clock() - self._start, nbytes)
        self._order.setdefault(param_index, len(self._order))

    def stop(self) -> None:
        if self._start is None:
            return
        elapsed = self._clock() - self._start
        self._start = None
        self._num_stopped += 1
        if self._num_stopped > self.skip_steps:
            self._steps.append((self._events, elapsed))
        self._events = {}

    def profile(self) -> BackwardProfile:
        """The mean profile of the kept steps (ValueError before any step was kept)."""
        if not self._steps:
            raise ValueError("BackwardRecorder: no profiled step yet")
        backward_s = sum(total for _, total in self._steps) / len(self._steps)
        seen: dict[int, list[tuple[float, int]]] = {}
        for events, _ in self._steps:
            for index, event in events.items():
                seen.setdefault(index, []).append(event)
        if not seen:
            raise ValueError("BackwardRecorder: no gradient was recorded")
        mean_ready = {i: sum(t for t, _ in ev) / len(ev) for i, ev in seen.items()}
        order = sorted(seen, key=lambda i: (mean_ready[i], self._order[i]))
        return BackwardProfile(
            ready_s=tuple(min(mean_ready[i], backward_s) for i in order),
            nbytes=tuple(seen[i][-1][1] for i in order),
            backward_s=backward_s,
            param_indices=tuple(order),
            num_steps=len(self._steps),
        )


def agree_profile(
    profile: BackwardProfile | None, group: dist.ProcessGroup | None, device: torch.device
) -> BackwardProfile:
    """Rank 0's profile on every rank of ``group`` (collective; servers pass None)."""
    if profile is None and dist.get_rank(group) == 0:
        raise ValueError("agree_profile: rank 0 has no backward profile to share")
    mine: list[float] = []
    if profile is not None:
        mine = [profile.backward_s, float(profile.num_steps)]
        mine += [*profile.ready_s, *map(float, profile.nbytes), *map(float, _indices(profile))]
    num_mine = profile.num_layers if profile is not None else 0
    header = torch.tensor([float(num_mine)], dtype=torch.float64)
    num = int(broadcast_from_rank0(header, group, device).item())
    values = torch.tensor(mine, dtype=torch.float64)
    if values.numel() != 2 + 3 * num:  # other ranks: any buffer of rank 0's length
        values = torch.zeros(2 + 3 * num, dtype=torch.float64)
    data = broadcast_from_rank0(values, group, device).tolist()
    return BackwardProfile(
        backward_s=data[0],
        num_steps=int(data[1]),
        ready_s=tuple(data[2 : 2 + num]),
        nbytes=tuple(int(x) for x in data[2 + num : 2 + 2 * num]),
        param_indices=tuple(int(x) for x in data[2 + 2 * num :]),
    )


def _indices(profile: BackwardProfile) -> Sequence[int]:
    return profile.param_indices or range(profile.num_layers)


@dataclass(frozen=True)
class Choice:
    """The chosen fusion threshold, the prediction for every candidate and the inputs."""

    bucket_bytes: int
    predicted_exposed_s: float
    tied_from_bytes: int  # the smallest candidate predicted as good (within the tie tolerance)
    candidates: tuple[tuple[int, float], ...]  # (bucket bytes, predicted exposed s), ascending
    reference_bytes: int
    reference_exposed_s: float
    world_size: int
    num_layers: int
    total_bytes: int
    backward_s: float
    alpha_s: float
    beta_bytes_per_s: float
    first_bucket_bytes: int | None

    @property
    def bucket_mb(self) -> float:
        """The threshold in MiB, as ``Engine(bucket_mb=...)`` takes it."""
        return self.bucket_bytes / 2**20

    def describe(self) -> str:
        """One line for the start-up log."""
        tied = ""
        if self.tied_from_bytes < self.bucket_bytes:
            tied = f", as good from {format_bytes(self.tied_from_bytes)}"
        return (
            f"fusion threshold {format_bytes(self.bucket_bytes)} (P={self.world_size}, "
            f"L={self.num_layers}, G={format_bytes(self.total_bytes)}, "
            f"E_b={self.backward_s * 1e3:.1f} ms, alpha={self.alpha_s * 1e6:.0f} us, "
            f"beta={format_rate(self.beta_bytes_per_s)}; predicted exposed "
            f"{self.predicted_exposed_s * 1e3:.1f} ms{tied} vs "
            f"{format_bytes(self.reference_bytes)}: {self.reference_exposed_s * 1e3:.1f} ms)"
        )

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "candidates"}
        if math.isinf(self.beta_bytes_per_s):
            data["beta_bytes_per_s"] = None
        return {**data, "candidates": [{"bytes": b, "exposed_s": x} for b, x in self.candidates]}


def choose_bucket_bytes(
    layers: Sequence[LayerCost],
    link: LinkModel,
    world_size: int,
    candidates: Sequence[int] | None = None,
    first_bucket_bytes: int | None = FIRST_BUCKET_BYTES,
    reference_bytes: int = REFERENCE_BYTES,
) -> Choice:
    """The candidate threshold with the least predicted exposed exchange (deterministic)."""
    if world_size < 1:
        raise ValueError(f"choose_bucket_bytes: world_size must be >= 1, got {world_size}")
    profile = BackwardProfile.from_layers(layers)
    sizes = sorted(set(default_candidates(profile) if candidates is None else candidates))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"choose_bucket_bytes: candidates must be >= 1 byte, got {candidates}")
    grads = _stand_ins(profile)
    exposed = [
        predict_exposed(profile, link, world_size, b, first_bucket_bytes, grads) for b in sizes
    ]
    best = min(exposed)
    tolerance = max(TIE_ABSOLUTE_S, TIE_RELATIVE * best)
    tied = [b for b, x in zip(sizes, exposed) if x <= best + tolerance]
    chosen = max(tied)
    reference = predict_exposed(profile, link, world_size, reference_bytes, first_bucket_bytes)
    return Choice(
        bucket_bytes=chosen,
        predicted_exposed_s=exposed[sizes.index(chosen)],
        tied_from_bytes=min(tied),
        candidates=tuple(zip(sizes, exposed)),
        reference_bytes=reference_bytes,
        reference_exposed_s=reference,
        world_size=world_size,
        num_layers=profile.num_layers,
        total_bytes=profile.total_bytes,
        backward_s=profile.backward_s,
        alpha_s=link.alpha_s,
        beta_bytes_per_s=link.beta_bytes_per_s,
        first_bucket_bytes=first_bucket_bytes,
    )


def default_candidates(
    profile: BackwardProfile, per_octave: int = CANDIDATES_PER_OCTAVE
) -> list[int]:
    """Log-spaced thresholds from the smallest gradient to the whole model (included)."""
    low = max(1, min(profile.nbytes))
    high = max(low, profile.total_bytes)
    num = max(1, math.ceil(math.log2(high / low) * per_octave))
    ratio = (high / low) ** (1.0 / num)
    return sorted({round(low * ratio**k) for k in range(num)} | {high})


def predict_exposed(
    profile: BackwardProfile,
    link: LinkModel,
    world_size: int,
    bucket_bytes: int,
    first_bucket_bytes: int | None = FIRST_BUCKET_BYTES,
    grads: list[torch.Tensor] | None = None,
) -> float:
    """Predicted seconds the exchange runs past backward with threshold ``bucket_bytes``."""
    grads = _stand_ins(profile) if grads is None else grads
    first = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
    groups = plan_buckets(grads, bucket_bytes, first)
    link_free = 0.0
    for group in groups:
        ready = profile.ready_s[group[-1]]  # ascending: the last member is ready last
        size = sum(profile.nbytes[i] for i in group)
        link_free = max(link_free, ready) + link.predict(size, world_size)
    return max(0.0, link_free - profile.backward_s)


def uniform_exposed(
    bucket_bytes: float,
    total_bytes: float,
    backward_s: float,
    alpha_s: float,
    beta_bytes_per_s: float,
    world_size: int,
) -> float:
    """The closed form of ``predict_exposed`` for evenly produced gradients (docs/exchange.md)."""
    cost = alpha_s * ring_latency_factor(world_size) + (
        bucket_bytes * ring_bandwidth_factor(world_size) / beta_bytes_per_s
    )
    num = total_bytes / bucket_bytes
    return max(cost, num * cost - (1.0 - 1.0 / num) * backward_s)


def _stand_ins(profile: BackwardProfile) -> list[torch.Tensor]:
    """One byte-sized meta tensor per gradient (no memory): what ``plan_buckets`` measures."""
    return [torch.empty(n, dtype=torch.uint8, device="meta") for n in profile.nbytes]


def uniform_optimum(
    total_bytes: float, backward_s: float, alpha_s: float, beta_bytes_per_s: float, world_size: int
) -> float:
    """b* = G min(1, sqrt(a / E_b), a / (E_b - w)) of the closed form (docs/exchange.md)."""
    latency = alpha_s * ring_latency_factor(world_size)
    wire = total_bytes * ring_bandwidth_factor(world_size) / beta_bytes_per_s
    if latency <= 0:
        return 0.0 if wire > 0 else float(total_bytes)
    fraction = math.sqrt(latency / backward_s)
    if backward_s > wire:
        fraction = min(fraction, latency / (backward_s - wire))
    return total_bytes * min(1.0, fraction)


def format_bytes(n: float) -> str:
    """'3.1 MiB', '48 KiB', '512 B'."""
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    if n >= 2**10:
        return f"{n / 2**10:.0f} KiB"
    return f"{n:.0f} B"


def format_rate(bytes_per_s: float) -> str:
    """'1.2 GB/s' (decimal), 'inf'."""
    if math.isinf(bytes_per_s):
        return "inf"
    return f"{bytes_per_s / 1e9:.2f} GB/s"
