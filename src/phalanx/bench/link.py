"""``phalanx bench link``: the link calibration's sweep and fit, and the threshold it implies for
each bench model. Method: docs/bench-methods.md, "link"."""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from phalanx import bench as common
from phalanx.bench.exchange import BENCH_MODELS, synthetic_batch
from phalanx.errors import ConfigError
from phalanx.exchange.comm import measure_handoff_s
from phalanx.exchange.link import (
    DEFAULT_REPEATS,
    DEFAULT_SIZES,
    LinkModel,
    calibrate,
    measure_message_s,
)
from phalanx.exchange.threshold import (
    BackwardProfile,
    BackwardRecorder,
    choose_bucket_bytes,
    format_bytes,
    format_rate,
    predict_exposed,
)
from phalanx.fields import option
from phalanx.models.zoo import MODELS
from phalanx.runtime.pool import WorkerPool, current_worker

MIB = 2**20
COMPARED_BYTES = (MIB, 25 * MIB)  # fixed thresholds shown next to the choice


@dataclass(frozen=True, kw_only=True)
class LinkBenchConfig:
    """Everything one ``phalanx bench link`` run needs (picklable: sent to the workers)."""

    nproc: int = option(2, "worker processes")
    rounds: int = option(5, "calibrations in a row")
    repeats: int = option(DEFAULT_REPEATS, "timed allreduces per size")
    sizes: tuple[int, ...] = DEFAULT_SIZES
    models: tuple[str, ...] = ("digits_cnn", "mlp")  # empty: no threshold section (--models)
    profile_steps: int = option(5, "profiled backward steps")
    batch_size: int = option(32, "per-process batch of the profiled models")
    seed: int = option(0, "weight seed")

    def validate(self) -> None:
        common.at_least(self, 1, "nproc", "rounds", "repeats", "profile_steps", "batch_size")
        if self.models:
            common.known("--models", self.models, tuple(BENCH_MODELS), what="model ")


# -- inside the workers -----------------------------------------------------------------------
def _calibrate_task(sizes: tuple[int, ...], repeats: int) -> dict[str, Any]:
    """One calibration on every worker; returns the model and how long it took (this rank)."""

    ctx = current_worker().context
    start = time.perf_counter()
    link = calibrate(ctx.group, ctx.device, sizes=sizes, repeats=repeats)
    seconds = time.perf_counter() - start
    link = replace(
        link,
        message_samples_s=measure_message_s(ctx.group, ctx.device),
        handoff_samples_s=measure_handoff_s(),  # every rank at once, as in a step
    )
    return {"link": link.to_dict(), "seconds": seconds}


def _profile_task(name: str, cfg: LinkBenchConfig) -> dict[str, Any]:
    """Backward profile of one bench model on this worker alone (no collectives)."""

    spec = BENCH_MODELS[name]
    torch.manual_seed(cfg.seed)
    model = MODELS.get(name)()
    params = [p for p in model.parameters() if p.requires_grad]
    recorder = BackwardRecorder(num_steps=cfg.profile_steps, skip_steps=1)
    handles = [
        p.register_post_accumulate_grad_hook(
            lambda p, i=i: recorder.record(i, p.numel() * p.element_size())
        )
        for i, p in enumerate(params)
    ]
    optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    x, y = synthetic_batch(spec, cfg.batch_size, cfg.seed, rank=0)
    while not recorder.done:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        recorder.start()
        loss.backward()
        recorder.stop()
        optimizer.step()
    for handle in handles:
        handle.remove()
    return recorder.profile().to_dict()


# -- the parent -------------------------------------------------------------------------------
def run_benchmark(cfg: LinkBenchConfig) -> dict[str, Any]:
    """Start the pool, calibrate ``rounds`` times, profile the models; every number."""

    started = time.perf_counter()
    with WorkerPool(cfg.nproc, threads=1, timeout_s=60.0) as pool:
        rounds = [pool.run(_calibrate_task, cfg.sizes, cfg.repeats)[0] for _ in range(cfg.rounds)]
        profiles = {name: pool.run_on(0, _profile_task, name, cfg) for name in cfg.models}
        backend = LinkModel.from_dict(rounds[0]["link"]).backend
    links = [LinkModel.from_dict(r["link"]) for r in rounds]
    median = LinkModel.median_of(links)
    thresholds = [
        _threshold(name, profile, median, cfg.nproc) for name, profile in profiles.items()
    ]
    return {
        "meta": _meta(cfg, backend, time.perf_counter() - started),
        "rounds": rounds,
        "median": median.to_dict(),
        "representative_round": _representative(links),
        "thresholds": thresholds,
    }


def _representative(links: list[LinkModel]) -> int:
    """Index of the round whose beta is the median (lower median for an even count)."""
    order = sorted(range(len(links)), key=lambda i: links[i].beta_bytes_per_s)
    return order[(len(order) - 1) // 2]


def _threshold(name: str, data: dict[str, Any], link: LinkModel, world: int) -> dict[str, Any]:
    profile = BackwardProfile.from_dict(data)
    choice = choose_bucket_bytes(profile.layer_costs(), link, world)
    compared = {
        str(b): predict_exposed(profile, link, world, b)
        for b in (*COMPARED_BYTES, profile.total_bytes)
    }
    return {
        "model": name,
        "profile": data,
        "choice": choice.to_dict(),
        "describe": choice.describe(),
        "compared_exposed_s": compared,
    }


def _meta(cfg: LinkBenchConfig, backend: str, wall_s: float) -> dict[str, Any]:
    return common.machine_meta(
        load_average=common.load_average(), backend=backend, wall_s=wall_s, config=asdict(cfg)
    )


# -- output -----------------------------------------------------------------------------------
def format_report(result: dict[str, Any]) -> str:
    """Header, the representative sweep, per-round fits, and the thresholds."""
    m, c = result["meta"], result["meta"]["config"]
    load = m["load_average"]
    lines = [
        f"phalanx bench link | {m['date']} | torch {m['torch']} | backend {m['backend']} | "
        f"nproc {c['nproc']} | cpus {m['cpu_count']} | rounds {c['rounds']} | "
        f"repeats {c['repeats']}" + (f" | load {load[0]:.1f}" if load else "")
    ]
    index = result["representative_round"]
    link = LinkModel.from_dict(result["rounds"][index]["link"])
    lines.append(f"sweep of round {index + 1} (median beta): ring allreduce of n bytes")
    rows = [("bytes", "median ms", "min ms", "max ms", "fitted ms", "fit error")]
    for n, samples in zip(link.sizes, link.samples_s):
        median, fitted = statistics.median(samples), link.predict(n)
        rows.append((format_bytes(n), f"{median * 1e3:.3f}", f"{min(samples) * 1e3:.3f}",
                     f"{max(samples) * 1e3:.3f}", f"{fitted * 1e3:.3f}",
                     f"{fitted / median - 1:+.0%}"))  # fmt: skip
    lines += common.aligned(rows, "  ")
    rows = [("round", "alpha us", "beta GB/s", "message us", "handoff us", "calibrate s")]
    for i, r in enumerate(result["rounds"]):
        fit = LinkModel.from_dict(r["link"])
        rows.append((str(i + 1), f"{fit.alpha_s * 1e6:.1f}", _gbps(fit.beta_bytes_per_s),
                     _micros(fit.message_s), _micros(fit.handoff_s),
                     f"{r['seconds']:.3f}"))  # fmt: skip
    middle = LinkModel.from_dict(result["median"])
    rows.append(("median", f"{middle.alpha_s * 1e6:.1f}", _gbps(middle.beta_bytes_per_s),
                 _micros(middle.message_s), _micros(middle.handoff_s), ""))  # fmt: skip
    lines += common.aligned(rows, "  ")
    lines.append(
        "message us: mean one-way time of a 4 KiB point-to-point message sent from a thread "
        "after a pause (the median row: the round with the median mean); `phalanx plan "
        "--cluster` on this file charges its excess over the link model to every message; "
        "handoff us: median latency of handing a job to the communication thread and of "
        "resuming after it (rank 0's), charged to every such hand-over"
    )
    for t in result["thresholds"]:
        lines.append(f"{t['model']}: {t['describe']}")
        compared = ", ".join(
            f"{'whole model' if int(b) == t['choice']['total_bytes'] else format_bytes(int(b))} "
            f"{x * 1e3:.1f} ms"
            for b, x in t["compared_exposed_s"].items()
        )
        lines.append(f"  predicted exposed with {compared}")
    return "\n".join(lines)


def _micros(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def _gbps(beta: float) -> str:
    return format_rate(beta).removesuffix(" GB/s")


def check(result: dict[str, Any]) -> None:
    for r in result["rounds"]:
        if not all(math.isfinite(s) and s > 0 for point in r["link"]["sweep"]
                   for s in point["samples_s"]):  # fmt: skip
            raise ConfigError("bench link: a non-finite or zero timing was measured")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models",
        default="digits_cnn,mlp",
        help="bench models to pick a threshold for (comma list; 'none' to skip)",
    )


def models_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    models = () if args.models == "none" else args.models.split(",")
    return {"models": tuple(m.strip() for m in models if m.strip())}


common.register("link", "link latency/bandwidth and threshold", LinkBenchConfig,
                run_benchmark, check, format_report, skip=("sizes", "models"),
                flags=add_flags, from_flags=models_from_flags)  # fmt: skip
