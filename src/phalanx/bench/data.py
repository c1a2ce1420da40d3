"""``phalanx bench data``: phalanx's Pipeline vs torch's DataLoader, same work, same CPU budget,
all in this process. Method: docs/bench-methods.md, "data"."""

from __future__ import annotations

import functools
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx import bench as common
from phalanx.data.pipeline import Pipeline
from phalanx.data.records import Field, RecordStore, write_store
from phalanx.data.sources import DataConfig, digits_arrays, load_source
from phalanx.engine import Engine
from phalanx.errors import ConfigError
from phalanx.fields import option
from phalanx.models.zoo import MODELS
from phalanx.runtime.context import RuntimeConfig

MEAN = np.array([0.2, 0.3, 0.4], dtype=np.float32)[:, None, None]  # per-channel, (3, 1, 1)
STD = np.array([0.3, 0.3, 0.3], dtype=np.float32)[:, None, None]
TINT = np.array([1.0, 0.8, 0.6], dtype=np.float32)  # the three channels differ a little
Batch = tuple[torch.Tensor, ...]
THROUGHPUT = (
    "dataloader",
    "dataloader-batched",
    "pipeline",
    "pipeline-per-sample",
    "pipeline-process",
)


@dataclass(frozen=True, kw_only=True)
class DataBenchConfig:
    """Everything one ``phalanx bench data`` run uses (recorded in the JSON)."""

    workers: int = option(2, "CPU workers of both sides")
    batch_size: int = option(64, "throughput batch")
    contenders: tuple[str, ...] = option(THROUGHPUT, "throughput contenders")
    image_size: int = option(64, "image side")
    crop: int = option(56, "crop side")
    rounds: int = option(5, "alternating throughput rounds")
    batches: int = option(60, "batches per block")
    warmup: int = option(5, "untimed batches/steps per block")
    train: bool = option(True, "the training comparison (--no-train: throughput only)")
    train_rounds: int = option(3, "training rounds")
    train_steps: int = option(60, "steps per block")
    train_batch_size: int = option(32, "training batch")
    settle_s: float = option(0.2, "seconds to settle between blocks")
    seed: int = option(0, "data seed")

    def validate(self) -> None:
        common.at_least(self, 1, "workers", "batch_size", "rounds", "batches")
        common.at_least(self, 1, "train_rounds", "train_steps", "train_batch_size")
        if not 0 < self.crop <= self.image_size:
            raise ConfigError(f"--crop: must be in [1, --image-size={self.image_size}]")
        common.known("--contenders", self.contenders, THROUGHPUT)
        common.at_least(self, 0, "warmup", "settle_s")


# -- the preprocessing (module level: picklable for worker processes) ---------------------------
def augment_sample(x: np.ndarray, rng: np.random.Generator, crop: int) -> np.ndarray:
    """uint8 (3, S, S) -> float32 (3, crop, crop): random crop, random flip, normalise."""
    i, j = rng.integers(0, x.shape[-1] - crop + 1, size=2)
    out = x[:, i : i + crop, j : j + crop]
    if rng.random() < 0.5:
        out = out[:, :, ::-1]
    return (out.astype(np.float32) * (1 / 255) - MEAN) / STD


def augment_batch(batch: Batch, rng: np.random.Generator, crop: int) -> Batch:
    """The same operations on a batch: x uint8 (B, 3, S, S) -> float32 (B, 3, crop, crop)."""
    x, y = batch[0].numpy(), batch[1]
    offsets = rng.integers(0, x.shape[-1] - crop + 1, size=(len(x), 2))
    flips = rng.random(len(x)) < 0.5
    out = np.empty((len(x), x.shape[1], crop, crop), dtype=np.float32)
    for k, ((i, j), flip) in enumerate(zip(offsets, flips)):
        window = x[k, :, i : i + crop, j : j + crop]
        out[k] = window[:, :, ::-1] if flip else window
    out *= 1 / 255  # whole-batch arithmetic: numpy releases the GIL
    out -= MEAN
    out /= STD
    return torch.from_numpy(out), y


class BatchAugment:
    """``augment_batch`` with a fixed crop, as a Pipeline preprocess (picklable)."""

    def __init__(self, crop: int) -> None:
        self.crop = crop

    def __call__(self, batch: Batch, rng: np.random.Generator) -> Batch:
        return augment_batch(batch, rng, self.crop)


class SampleAugment(BatchAugment):
    """``augment_sample`` applied to each sample of a batch (the per-sample form)."""

    def __call__(self, batch: Batch, rng: np.random.Generator) -> Batch:
        x = batch[0].numpy()
        out = np.stack([augment_sample(sample, rng, self.crop) for sample in x])
        return torch.from_numpy(out), batch[1]


class StoreDataset(torch.utils.data.Dataset):
    """The record store as a torch Dataset: per index (one sample) or per list (a batch)."""

    def __init__(self, path: str, crop: int | None) -> None:
        self.store = RecordStore(path)
        self.crop = crop
        self._rng: np.random.Generator | None = None

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, index: Any) -> Any:
        rng = self._worker_rng()
        if isinstance(index, list):  # a batch from a BatchSampler
            x, y = self.store.read_batch(index)
            batch = (torch.from_numpy(x), torch.from_numpy(y))
            return batch if self.crop is None else augment_batch(batch, rng, self.crop)
        x, y = self.store[index]
        return (x if self.crop is None else augment_sample(x, rng, self.crop)), y

    def _worker_rng(self) -> np.random.Generator:
        if self._rng is None:
            info = torch.utils.data.get_worker_info()
            self._rng = np.random.default_rng(info.seed if info else 0)
        return self._rng


# -- data ------------------------------------------------------------------------------------------
def upscaled_digits(size: int) -> tuple[np.ndarray, np.ndarray]:
    """The 1797 digits as uint8 (N, 3, size, size) (bilinear upscaling, tinted) and int64 (N,)."""
    images, target = digits_arrays()
    x = torch.from_numpy(images.astype(np.float32) / 16.0)[:, None]
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    tinted = x.numpy() * TINT[None, :, None, None] * 255.0
    return np.clip(tinted, 0, 255).astype(np.uint8), target.astype(np.int64)


def write_image_store(path: Path, size: int) -> None:
    x, y = upscaled_digits(size)
    fields = (Field("x", "|u1", (3, size, size)), Field("y", "<i8", ()))
    write_store(path, fields, zip(x, y), shard_bytes=8 << 20, meta={"source": "bench"}).close()


# -- feeders: one interface over DataLoader and Pipeline ------------------------------------------
@dataclass
class Feeder:
    """A contender: ``restart()`` empties its prefetch, ``next()`` is one batch."""

    name: str
    restart: Callable[[], None]
    next: Callable[[], Batch]
    close: Callable[[], None]


def dataloader_feeder(
    name: str, dataset: Any, cfg: DataBenchConfig, batch_size: int, batched: bool, total: int
) -> Feeder:
    """DataLoader with ``cfg.workers`` persistent workers; each restart is a new iterator."""
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    generator = torch.Generator().manual_seed(cfg.seed)
    sampler = RandomSampler(dataset, num_samples=total * batch_size, generator=generator)
    common: dict[str, Any] = {
        "num_workers": cfg.workers,
        "persistent_workers": True,
        "prefetch_factor": 2,
    }
    if batched:
        batches = BatchSampler(sampler, batch_size, drop_last=True)
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, sampler=batches, **common)
    else:
        loader = DataLoader(dataset, batch_size, sampler=sampler, drop_last=True, **common)
    state: dict[str, Iterator[Batch]] = {}

    def restart() -> None:
        state["it"] = iter(loader)

    def close() -> None:
        state.clear()
        gc.collect()

    return Feeder(name, restart, lambda: tuple(next(state["it"])), close)


def pipeline_feeder(name: str, source: Any, cfg: DataBenchConfig, batch_size: int,
                    preprocess: Any, pool: str = "thread") -> Feeder:  # fmt: skip
    pipe = Pipeline(source, batch_size, preprocess, workers=cfg.workers, seed=cfg.seed,
                    rank=0, world_size=1, pool=pool)  # fmt: skip

    def restart() -> None:
        pipe.load_state_dict(pipe.state_dict())  # stops the threads, drops prepared batches

    return Feeder(name, restart, pipe.next, pipe.close)


def throughput_feeders(cfg: DataBenchConfig, store: str) -> list[Feeder]:
    total = (cfg.warmup + cfg.batches) * 2
    makers: dict[str, Callable[[], Feeder]] = {
        "dataloader": lambda: dataloader_feeder(
            "dataloader", StoreDataset(store, cfg.crop), cfg, cfg.batch_size, False, total
        ),
        "dataloader-batched": lambda: dataloader_feeder(
            "dataloader-batched", StoreDataset(store, cfg.crop), cfg, cfg.batch_size, True, total
        ),
        "pipeline": lambda: pipeline_feeder(
            "pipeline", store, cfg, cfg.batch_size, BatchAugment(cfg.crop)
        ),
        "pipeline-per-sample": lambda: pipeline_feeder(
            "pipeline-per-sample", store, cfg, cfg.batch_size, SampleAugment(cfg.crop)
        ),
        "pipeline-process": lambda: pipeline_feeder(
            "pipeline-process", store, cfg, cfg.batch_size, SampleAugment(cfg.crop), "process"
        ),
    }
    # DataLoaders first: their workers fork before any pipeline thread or pool exists
    return [makers[n]() for n in sorted(cfg.contenders, key=lambda n: not n.startswith("data"))]


# -- measuring -------------------------------------------------------------------------------------
def run_throughput(cfg: DataBenchConfig, feeders: list[Feeder]) -> dict[str, list[float]]:
    """Seconds per block of ``cfg.batches`` batches, per contender, over the rounds."""
    seconds: dict[str, list[float]] = {f.name: [] for f in feeders}
    for f in feeders:  # warm-up: start workers and pools, fill caches
        f.restart()
        for _ in range(cfg.warmup + 1):
            f.next()
    for r in range(cfg.rounds):
        for f in common.rotate(feeders, r):
            time.sleep(cfg.settle_s)
            f.restart()
            start = time.perf_counter()
            for _ in range(cfg.batches):
                f.next()
            seconds[f.name].append(time.perf_counter() - start)
    return seconds


@dataclass
class Trainee:
    """One training contender: an Engine on its own copy of the model, and its feeder."""

    feeder: Feeder
    engine: Any


def train_block(cfg: DataBenchConfig, trainee: Trainee) -> dict[str, float]:
    """``warmup`` untimed steps, then ``train_steps`` timed: input wait and step time."""
    trainee.feeder.restart()
    for _ in range(cfg.warmup):
        trainee.engine.step(*trainee.feeder.next()[:2])
    wait = total = 0.0
    for _ in range(cfg.train_steps):
        start = time.perf_counter()
        batch = trainee.feeder.next()
        got = time.perf_counter()
        trainee.engine.step(*batch[:2])
        del batch  # freeing the batch belongs to the step, not to the input wait
        wait += got - start
        total += time.perf_counter() - start
    return {"wait_s": wait, "step_s": total}


def cnn(crop: int) -> nn.Module:
    """A small CNN on 3 x crop x crop images; its step costs more than the preprocessing."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, 10),
    )  # fmt: skip


def run_training(cfg: DataBenchConfig, store: str) -> list[dict[str, Any]]:
    """Both training cases; per case and feeder: per-round wait and step seconds."""
    digits = load_source(DataConfig(source="digits"))
    in_memory = torch.utils.data.TensorDataset(digits.x_train, digits.y_train)
    total = (cfg.warmup + cfg.train_steps) * 2
    b = cfg.train_batch_size
    cases = [
        (f"cnn on augmented 3x{cfg.crop}x{cfg.crop}", lambda: cnn(cfg.crop), [
            lambda: pipeline_feeder("pipeline", store, cfg, b, BatchAugment(cfg.crop)),
            lambda: dataloader_feeder("dataloader-batched", StoreDataset(store, cfg.crop), cfg,
                                      b, True, total),
        ]),
        ("digits_cnn on in-memory 8x8", lambda: MODELS.get("digits_cnn")(), [
            lambda: pipeline_feeder("pipeline", (digits.x_train, digits.y_train), cfg, b, None),
            lambda: dataloader_feeder("dataloader", in_memory, cfg, b, False, total),
        ]),
    ]  # fmt: skip
    sgd = functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)
    results = []
    for label, make_model, makers in cases:
        trainees = []
        for make in reversed(makers):  # DataLoader first (fork before threads)
            torch.manual_seed(cfg.seed)
            trainees.append(Trainee(make(), Engine(make_model(), F.cross_entropy, sgd)))
        rounds: dict[str, list[dict[str, float]]] = {t.feeder.name: [] for t in trainees}
        for r in range(cfg.train_rounds):
            for t in common.rotate(trainees, r):
                time.sleep(cfg.settle_s)
                rounds[t.feeder.name].append(train_block(cfg, t))
        for t in trainees:
            t.feeder.close()
            t.engine.close()
        results.append(summarize_training(label, b, cfg.train_steps, rounds))
    return results


# -- summaries -------------------------------------------------------------------------------------
def summarize_throughput(cfg: DataBenchConfig, seconds: dict[str, list[float]]) -> dict[str, Any]:
    samples = cfg.batches * cfg.batch_size
    out: dict[str, Any] = {}
    for name, secs in seconds.items():
        sps = [samples / s for s in secs]
        out[name] = {"seconds": secs, "samples_per_s": sps,
                     "median_samples_per_s": statistics.median(sps)}  # fmt: skip
    for name in [n for n in out if n.startswith("pipeline")]:
        for base in ("dataloader", "dataloader-batched"):
            if name in out and base in out:
                ratios = [a / b for a, b in zip(out[name]["samples_per_s"],
                                                out[base]["samples_per_s"])]  # fmt: skip
                out[name][f"vs_{base}"] = ratios
                out[name][f"median_vs_{base}"] = statistics.median(ratios)
    return out


def summarize_training(
    label: str, batch_size: int, steps: int, rounds: dict[str, list[dict[str, float]]]
) -> dict[str, Any]:
    feeders = {}
    for name, blocks in rounds.items():
        wait = [b["wait_s"] for b in blocks]
        step = [b["step_s"] for b in blocks]
        fractions = [w / s for w, s in zip(wait, step)]
        feeders[name] = {
            "wait_fraction": fractions,
            "median_wait_fraction": statistics.median(fractions),
            "median_wait_ms_per_step": statistics.median(wait) / steps * 1e3,
            "median_step_ms": statistics.median(step) / steps * 1e3,
            "median_samples_per_s": statistics.median(batch_size * steps / s for s in step),
        }
    return {"case": label, "batch_size": batch_size, "steps_per_round": steps, "feeders": feeders}


def run_benchmark(cfg: DataBenchConfig) -> dict[str, Any]:
    """Throughput then training, in this process; returns every number."""
    started, load_before = time.perf_counter(), os.getloadavg()
    ctx = phalanx.init(RuntimeConfig(threads=1))  # one intra-op thread, like DataLoader workers
    try:
        with tempfile.TemporaryDirectory(prefix="phalanx-bench-data-") as tmp:
            store = os.path.join(tmp, "store")
            write_image_store(Path(store), cfg.image_size)
            feeders = throughput_feeders(cfg, store)
            try:
                seconds = run_throughput(cfg, feeders)
            finally:
                for f in feeders:
                    f.close()
            training = run_training(cfg, store) if cfg.train else []
    finally:
        phalanx.shutdown()
    meta = common.machine_meta(
        backend=ctx.backend, threads_per_process=torch.get_num_threads(), load_before=load_before,
        load_after=os.getloadavg(), wall_s=time.perf_counter() - started, config=asdict(cfg),
    )  # fmt: skip
    return {"meta": meta, "throughput": summarize_throughput(cfg, seconds), "training": training}


# -- output ----------------------------------------------------------------------------------------
def format_report(result: dict[str, Any]) -> str:
    m, c = result["meta"], result["meta"]["config"]
    lines = [
        f"phalanx bench data | {m['date']} | torch {m['torch']} | cpus {m['cpu_count']} | "
        f"workers {c['workers']} | load {m['load_before'][0]:.2f} -> {m['load_after'][0]:.2f}",
        f"throughput: batch {c['batch_size']}, uint8 3x{c['image_size']}x{c['image_size']} -> "
        f"crop {c['crop']} + flip + normalise, {c['batches']} batches x {c['rounds']} rounds",
    ]
    rows = [["contender", "samples/s", "per-round range", "vs dataloader", "vs dl-batched"]]
    for name, t in result["throughput"].items():
        sps = t["samples_per_s"]
        rows.append([
            name, f"{t['median_samples_per_s']:,.0f}", f"{min(sps):,.0f} - {max(sps):,.0f}",
            _ratio(t, "median_vs_dataloader"), _ratio(t, "median_vs_dataloader-batched"),
        ])  # fmt: skip
    lines += common.aligned(rows, "  ")
    for case in result["training"]:
        lines.append(f"training: {case['case']}, batch {case['batch_size']}, "
                     f"{case['steps_per_round']} steps x {c['train_rounds']} rounds")  # fmt: skip
        rows = [["feeder", "input wait", "wait ms/step", "step ms", "samples/s"]]
        for name, f in case["feeders"].items():
            rows.append([
                name, f"{f['median_wait_fraction']:.2%}", f"{f['median_wait_ms_per_step']:.3f}",
                f"{f['median_step_ms']:.2f}", f"{f['median_samples_per_s']:,.0f}",
            ])  # fmt: skip
        lines += common.aligned(rows, "  ")
    return "\n".join(lines)


def _ratio(entry: dict[str, Any], key: str) -> str:
    return f"{entry[key]:.2f}x" if key in entry else "-"


def check(result: dict[str, Any]) -> None:
    for name, entry in result["throughput"].items():
        if not all(s > 0 for s in entry["samples_per_s"]):
            raise ConfigError(f"bench data: {name} delivered no samples")


common.register("data", "input Pipeline vs torch DataLoader", DataBenchConfig,
                run_benchmark, check, format_report)  # fmt: skip
