"""Link calibration: the group's per-message latency alpha and bandwidth beta (F12 inputs),
fitted to the ring allreduce T(n) = 2 (p-1) alpha + 2 (p-1)/p * n / beta (docs/exchange.md).

``calibrate``'s phases:
  Phase 1 (warm-up): one allreduce of every size, so connections and buffers exist.
  Phase 2 (sweep): ``repeats`` rounds of one timed allreduce per size, each after an untimed
    one-element allreduce that lines the ranks up (else a small message times the skew).
  Phase 3 (agree): rank 0's timings broadcast: every rank gets bit-identical alpha and beta.
  Phase 4 (fit): the median time per size, then a least-squares line through them.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.exchange.comm import global_rank
from phalanx.fileio import atomic_write_text

# 4 KiB .. 16 MiB, powers of 4. The 16 MiB point matters: up to 4 MiB a message stays in the CPU
# caches; at the 16-64 MiB of big buckets loopback Gloo cost up to 1.4x more per byte here.
DEFAULT_SIZES = tuple(4**k for k in range(6, 13))
DEFAULT_REPEATS = 9  # medians of 9: robust to a few preempted samples on a busy machine
LINK_FILE = "link.json"
MESSAGE_PROBE_BYTES = 4096  # measure_message_s: small, so the time is the software's
MESSAGE_REPEATS = 200  # ~0.3 s: the mean of a heavy tail needs many samples
MESSAGE_PAUSE_S = 1e-3


def ring_latency_factor(world_size: int) -> float:
    """f(p): messages in series per ring allreduce (p-1 reduce-scatter + p-1 all-gather steps)."""
    return 2.0 * (world_size - 1)


def ring_bandwidth_factor(world_size: int) -> float:
    """g(p): bytes each rank sends per byte of the message in a ring allreduce."""
    return 2.0 * (world_size - 1) / world_size


@dataclass(frozen=True)
class LinkModel:
    """Fitted latency and bandwidth of one process group, with its sweep and probes."""

    alpha_s: float
    beta_bytes_per_s: float
    world_size: int
    sizes: tuple[int, ...] = ()
    samples_s: tuple[tuple[float, ...], ...] = ()
    backend: str = ""
    message_samples_s: tuple[float, ...] = ()
    handoff_samples_s: tuple[float, ...] = ()

    @property
    def message_s(self) -> float | None:
        """The mean of ``message_samples_s`` (None when not measured)."""
        return statistics.fmean(self.message_samples_s) if self.message_samples_s else None

    @property
    def handoff_s(self) -> float | None:
        """The median of ``handoff_samples_s`` (None when not measured)."""
        return statistics.median(self.handoff_samples_s) if self.handoff_samples_s else None

    def predict(self, nbytes: float, world_size: int | None = None) -> float:
        """Seconds of one ring allreduce of ``nbytes``: alpha f(p) + n g(p) / beta."""
        p = self.world_size if world_size is None else world_size
        bandwidth = ring_bandwidth_factor(p) * nbytes / self.beta_bytes_per_s
        return ring_latency_factor(p) * self.alpha_s + bandwidth

    @property
    def medians_s(self) -> tuple[float, ...]:
        """The median time of each swept size (what the line is fitted to)."""
        return tuple(statistics.median(s) for s in self.samples_s)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (an infinite beta is written as null)."""
        beta = self.beta_bytes_per_s
        return {
            "alpha_s": self.alpha_s,
            "beta_bytes_per_s": None if math.isinf(beta) else beta,
            "world_size": self.world_size,
            "backend": self.backend,
            "model": "ring: T(n) = 2(p-1) alpha + 2(p-1)/p n/beta",
            "sweep": [
                {"bytes": n, "median_s": statistics.median(s), "samples_s": list(s)}
                for n, s in zip(self.sizes, self.samples_s)
            ],
            "message": {
                "bytes": MESSAGE_PROBE_BYTES,
                "mean_s": self.message_s,
                "samples_s": list(self.message_samples_s),
            },
            "handoff": {"median_s": self.handoff_s, "samples_s": list(self.handoff_samples_s)},
        }

    @classmethod
    def median_of(cls, links: list[LinkModel]) -> LinkModel:
        """One model from several calibrations: median alpha and beta, and each probe's samples
        from its (lower) median round, so one round's slow wake-ups do not set the model."""
        assert links, "median_of: no calibrations"

        def middle(samples: str, statistic: str) -> tuple[float, ...]:
            measured = [link for link in links if getattr(link, samples)]
            if not measured:
                return ()
            measured.sort(key=lambda link: getattr(link, statistic))
            return getattr(measured[(len(measured) - 1) // 2], samples)

        return cls(
            alpha_s=statistics.median(link.alpha_s for link in links),
            beta_bytes_per_s=statistics.median(link.beta_bytes_per_s for link in links),
            world_size=links[0].world_size,
            backend=links[0].backend,
            message_samples_s=middle("message_samples_s", "message_s"),
            handoff_samples_s=middle("handoff_samples_s", "handoff_s"),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LinkModel:
        """Inverse of ``to_dict``; a missing or malformed key is a one-line ValueError."""
        try:
            beta = data["beta_bytes_per_s"]
            sweep = data.get("sweep", [])
            return cls(
                alpha_s=float(data["alpha_s"]),
                beta_bytes_per_s=math.inf if beta is None else float(beta),
                world_size=int(data["world_size"]),
                sizes=tuple(int(point["bytes"]) for point in sweep),
                samples_s=tuple(tuple(map(float, point["samples_s"])) for point in sweep),
                backend=str(data.get("backend", "")),
                message_samples_s=tuple(map(float, data.get("message", {}).get("samples_s", []))),
                handoff_samples_s=tuple(map(float, data.get("handoff", {}).get("samples_s", []))),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"link model: missing or bad field ({type(e).__name__}: {e})"
            ) from None

    def save(self, run_dir: Path | str) -> Path:
        """Write ``run_dir/link.json`` atomically; returns its path."""
        path = Path(run_dir) / LINK_FILE
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Path | str) -> LinkModel:
        """Read a ``link.json`` (or a directory holding one, or ``bench link --json``)."""
        path = Path(path)
        if path.is_dir():
            path = path / LINK_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read link model ({e})") from None
        if isinstance(data, dict) and "alpha_s" not in data and "median" in data:
            data = data["median"]  # the --json of `phalanx bench link`: its median model
        return cls.from_dict(data)


def fit_line(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(A, B) of T(n) = A + B n, least squares on relative residuals (every size alike)."""
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ValueError("fit_line: needs at least two distinct sizes, one time per size")
    scale = max(sizes)  # sizes in units of the largest keep the normal equations well scaled
    xs = [n / scale for n in sizes]
    ws = [1.0 / max(t, 1e-12) ** 2 for t in seconds]
    sw = sum(ws)
    sx = sum(w * x for w, x in zip(ws, xs))
    sy = sum(w * t for w, t in zip(ws, seconds))
    sxx = sum(w * x * x for w, x in zip(ws, xs))
    sxy = sum(w * x * t for w, x, t in zip(ws, xs, seconds))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    intercept = (sy - slope * sx) / sw
    if intercept < 0:
        intercept, slope = 0.0, sxy / sxx
    if slope < 0:
        intercept, slope = sy / sw, 0.0
    return intercept, slope / scale


def model_from_fit(
    intercept_s: float, slope_s_per_byte: float, world_size: int, **sweep: Any
) -> LinkModel:
    """Convert T(n) = A + B n measured on ``world_size`` ranks into the ring's alpha and beta."""
    assert world_size > 1, "a world of one has no link to fit"
    alpha = intercept_s / ring_latency_factor(world_size)
    beta = (
        ring_bandwidth_factor(world_size) / slope_s_per_byte if slope_s_per_byte > 0 else math.inf
    )
    return LinkModel(alpha_s=alpha, beta_bytes_per_s=beta, world_size=world_size, **sweep)


def calibrate(
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = DEFAULT_REPEATS,
) -> LinkModel:
    """Measure ``group``'s allreduce over ``sizes`` and fit alpha and beta (collective)."""
    sizes = tuple(int(n) for n in sizes)
    if len(set(sizes)) < 2 or min(sizes) < 4:
        raise ValueError(f"calibrate: sizes needs two distinct sizes >= 4 bytes, got {sizes}")
    if repeats < 1:
        raise ValueError(f"calibrate: repeats must be >= 1, got {repeats}")
    device = torch.device(device)
    world_size = dist.get_world_size(group)
    backend = str(dist.get_backend(group))
    if world_size == 1:
        return LinkModel(alpha_s=0.0, beta_bytes_per_s=math.inf, world_size=1, backend=backend)
    buffer = torch.zeros(max(sizes) // 4, dtype=torch.float32, device=device)
    messages = [buffer[: n // 4] for n in sizes]
    # Phase 1: warm-up.
    for message in messages:
        dist.all_reduce(message, group=group)
    _sync(device)
    # Phase 2: sweep, size after size in each repeat: a burst of load from other processes
    # then spoils one sample of several sizes instead of every sample of one size.
    samples = torch.zeros(len(sizes), repeats, dtype=torch.float64)
    token = torch.zeros(1, dtype=torch.float32, device=device)
    for r in range(repeats):
        for i, message in enumerate(messages):
            dist.all_reduce(token, group=group)
            _sync(device)
            start = time.perf_counter()
            dist.all_reduce(message, group=group)
            _sync(device)
            samples[i, r] = time.perf_counter() - start
    # Phase 3: agree on rank 0's timings.
    samples = broadcast_from_rank0(samples, group, device)
    # Phase 4: fit the medians.
    per_size = tuple(tuple(row) for row in samples.tolist())
    nbytes = tuple(m.numel() * m.element_size() for m in messages)
    intercept, slope = fit_line(nbytes, [statistics.median(s) for s in per_size])
    return model_from_fit(
        intercept, slope, world_size, sizes=nbytes, samples_s=per_size, backend=backend
    )


def broadcast_from_rank0(
    values: torch.Tensor, group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    """Rank 0's ``values`` (float64, CPU, one shape everywhere) on every rank, via ``device``."""
    assert values.dtype == torch.float64, "values travel as float64"
    on_device = values.to(device)
    # The group's rank 0 as a global rank: broadcast by group rank needs torch >= 2.6.
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast(on_device, src=src, group=group)
    return on_device.cpu()


def measure_message_s(
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    nbytes: int = MESSAGE_PROBE_BYTES,
    repeats: int = MESSAGE_REPEATS,
    pause_s: float = MESSAGE_PAUSE_S,
) -> tuple[float, ...]:
    """One-way times of a small message between ranks 0 and 1, sent from a thread after a
    pause, as the strategies send theirs (collective; rank 0's samples everywhere). Their mean
    is what steps pay: the samples are heavy-tailed, and a median would hide the cost.
      Phase 1 (warm-up): two round trips.
      Phase 2 (ping-pong): ``repeats`` round trips, each after ``pause_s`` of sleep.
      Phase 3 (agree): rank 0's samples are broadcast."""
    device = torch.device(device)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if world_size == 1:
        return ()
    samples = torch.zeros(repeats, dtype=torch.float64)
    message = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    peer = global_rank(group, 1 - rank) if rank < 2 else -1

    def round_trip() -> float:
        start = time.perf_counter()
        if rank == 0:
            dist.send(message, peer, group=group)
            dist.recv(message, peer, group=group)
        else:
            dist.recv(message, peer, group=group)
            dist.send(message, peer, group=group)
        _sync(device)
        return (time.perf_counter() - start) / 2

    def probe() -> None:
        for _ in range(2):  # Phase 1
            round_trip()
        for i in range(repeats):  # Phase 2
            time.sleep(pause_s)
            samples[i] = round_trip()

    if rank < 2:  # on its own thread, the caller's asleep, as a communication thread runs
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="phalanx-link-probe") as pool:
            pool.submit(probe).result()
    return tuple(broadcast_from_rank0(samples, group, device).tolist())  # Phase 3


def _sync(device: torch.device) -> None:
    """Wait for queued device work (CUDA collectives return before they finish)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
