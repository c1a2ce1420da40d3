"""The fusion threshold (F12) from measurements: backward profile x link model -> bucket bytes.

The threshold reads the one per-layer cost type, ``phalanx.costs.LayerCost`` (layers in backward
order: each one's backward seconds and the bytes of the gradients ready when it ends), from
either producer: the one per-layer profiler (``memory/profile.py``, what ``phalanx plan`` uses)
or, in a live run, ``BackwardRecorder``, which notes during the first steps when each
parameter's gradient became ready and how many bytes it has (one ``LayerCost`` per gradient).
``BackwardProfile`` is the replay form of those layers (E_b, L, bytes and ready time per
gradient; ``from_layers`` / ``layer_costs`` convert). ``choose_bucket_bytes(layers, link, P)``
replays them through the bucket planner of ``phalanx.exchange.buckets`` for a set of candidate
thresholds b and predicts, for each, how long the exchange runs past the end of backward:

  - a bucket is ready when its last gradient is (the profile's measured ready times);
  - the link serves buckets one at a time, in bucket order; a bucket of s bytes takes
    c(s) = alpha f(P) + s g(P) / beta (ring: f = 2(P-1), g = 2(P-1)/P; ``phalanx.exchange.link``);
  - exposed(b) = (when the last bucket finishes) - (when backward ends), at least 0.

The smallest predicted exposed time wins; near-ties (within 1 % or 1 us) go to the larger b,
which sends fewer messages (per-bucket costs the model omits: hooks, launches). The closed form
of the same model for uniformly produced gradients is ``uniform_optimum`` (derived in
docs/exchange.md, "The fusion threshold (F12)").
"""

from __future__ import annotations

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


# -- the backward profile ---------------------------------------------------------------------
@dataclass(frozen=True)
class BackwardProfile:
    """When each gradient became ready during backward, averaged over the profiled steps.

    ``ready_s[i]``: seconds from the start of backward until gradient i was accumulated
    (ascending, within [0, backward_s]); ``nbytes[i]``: its bytes; ``param_indices[i]``: which
    parameter (the Engine's index into its trainable parameters). ``backward_s`` is E_b, the mean
    backward time. L (``num_layers``) counts parameters with gradients: the unit the buckets hold.
    """

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
        """Layers in backward order: each gradient is ready when its layer's backward ends;
        E_b is the layers' backward in all (a layer without gradients only adds time)."""
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
        """One ``LayerCost`` per gradient, in backward order, whose backward runs from the
        previous gradient's ready time to its own; backward left after the last gradient (the
        input gradient of the first layer) is a layer without gradients. ``forward_s`` (which
        this profile does not measure) is split in proportion to the backward times."""
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
    """Records the backward profile of the first steps, for the Engine's hooks to feed.

    Per step: ``start()`` right before ``backward()``; ``record(param_index, nbytes)`` from the
    post-accumulate-grad hook (no-op while not started or once done, so the hook may call it
    unconditionally); ``stop()`` when backward returned. The first ``skip_steps`` steps are
    discarded (first-step allocations and lazy initialisation are not the steady state); after
    ``num_steps`` kept steps ``done`` is True and ``profile()`` averages them: E_b is the mean
    backward time, each gradient's ready time the mean over the steps that produced it.
    """

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

    @property
    def active(self) -> bool:
        return self._start is not None

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
    """Rank 0's profile on every rank of ``group`` (collective), so all choose the same b.

    Ranks without a backward of their own (e.g. dedicated parameter servers) pass None; rank 0
    must pass a profile.
    """
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


# -- the threshold ----------------------------------------------------------------------------
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
        beta = self.beta_bytes_per_s
        return {
            "bucket_bytes": self.bucket_bytes,
            "predicted_exposed_s": self.predicted_exposed_s,
            "tied_from_bytes": self.tied_from_bytes,
            "reference_bytes": self.reference_bytes,
            "reference_exposed_s": self.reference_exposed_s,
            "world_size": self.world_size,
            "num_layers": self.num_layers,
            "total_bytes": self.total_bytes,
            "backward_s": self.backward_s,
            "alpha_s": self.alpha_s,
            "beta_bytes_per_s": None if math.isinf(beta) else beta,
            "first_bucket_bytes": self.first_bucket_bytes,
            "candidates": [{"bytes": b, "exposed_s": x} for b, x in self.candidates],
        }


def choose_bucket_bytes(
    layers: Sequence[LayerCost],
    link: LinkModel,
    world_size: int,
    candidates: Sequence[int] | None = None,
    first_bucket_bytes: int | None = FIRST_BUCKET_BYTES,
    reference_bytes: int = REFERENCE_BYTES,
) -> Choice:
    """The candidate threshold with the smallest predicted exposed exchange (see module doc).

    ``layers``: in backward order (``BackwardProfile.from_layers``). ``candidates`` (bytes)
    default to ``default_candidates``: log-spaced from the smallest gradient to the whole model.
    ``first_bucket_bytes`` caps the first bucket as ``GradientBuckets`` does (None:
    no cap). Deterministic: equal inputs give equal choices on every rank.
    """
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
    """Predicted seconds the exchange runs past backward with threshold ``bucket_bytes``.

    Buckets come from ``plan_buckets`` over the gradients in ready order: the grouping the
    Engine builds (``first_bucket_bytes`` None: no cap). ``grads`` are the stand-ins of
    ``_stand_ins(profile)``, passed in to reuse them across candidates.
    """
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
    """The closed form of ``predict_exposed`` for G bytes produced at an even pace over E_b,
    in n = G/b equal buckets without a first-bucket cap (exact when n is a whole number):

        exposed(b) = max(c(b), n c(b) - (1 - 1/n) E_b),  c(b) = alpha f(P) + b g(P) / beta.
    """
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
    """b* of the closed form for gradients produced at an even pace (no first-bucket cap):

    with a = alpha f(P) and w = G g(P) / beta,  b* = G min(sqrt(a / E_b), a / (E_b - w)), the
    second term only when E_b > w; clipped to at most G. See docs/exchange.md for the algebra.
    """
    latency = alpha_s * ring_latency_factor(world_size)
    wire = total_bytes * ring_bandwidth_factor(world_size) / beta_bytes_per_s
    if latency <= 0:
        return 0.0 if wire > 0 else float(total_bytes)
    fraction = math.sqrt(latency / backward_s)
    if backward_s > wire:
        fraction = min(fraction, latency / (backward_s - wire))
    return total_bytes * min(1.0, fraction)


# -- formatting -------------------------------------------------------------------------------
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
