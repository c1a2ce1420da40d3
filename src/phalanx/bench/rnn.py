"""``phalanx bench rnn``: character-level LSTM tokens/s on 1 process, torch DDP, the phalanx
Engine and the WorkerPool flow (F15), all in one pool's processes. Method:
docs/bench-methods.md, "rnn"."""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from phalanx import bench as common
from phalanx.data import DataConfig, load_source
from phalanx.engine import Engine
from phalanx.errors import WorkerError
from phalanx.fields import option
from phalanx.models.layers import build_layers
from phalanx.runtime.pool import WorkerPool, current_worker

LR, MOMENTUM = 0.05, 0.9
CONTENDERS = ("single", "ddp", "phalanx", "pool")


@dataclass(frozen=True, kw_only=True)
class RnnBenchConfig:
    """Everything one ``phalanx bench rnn`` run needs (sent to the workers)."""

    nproc: int = option(2, "worker processes")
    embed: int = option(64, "embedding size")
    hidden: int = option(256, "LSTM hidden size")
    seq_len: int = option(64, "characters per sequence")
    batch_size: int = option(32, "sequences per process per step")
    steps: int = option(20, "steps per round and contender")
    rounds: int = option(5, "alternating rounds")
    warmup: int = option(5, "warm-up steps per contender")
    seed: int = option(0, "weight seed")

    def validate(self) -> None:
        common.at_least(
            self, 1, "nproc", "embed", "hidden", "seq_len", "batch_size", "steps", "rounds"
        )
        common.at_least(self, 0, "warmup")

    def layers(self, vocab: int) -> list[dict[str, Any]]:
        """The char LSTM of configs/char_lstm.toml: ids (B, T) -> logits (B, T, vocab)."""
        return [
            {"type": "embedding", "num_embeddings": vocab, "embedding_dim": self.embed},
            {"type": "lstm", "input_size": self.embed, "hidden_size": self.hidden},
            {"type": "linear", "in_features": self.hidden, "out_features": vocab},
        ]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _make_model(layers: list[dict[str, Any]], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return build_layers(layers)


# -- in the workers -----------------------------------------------------------------------------
@dataclass
class _Bench:
    """A worker's contenders: name -> step function; batches come from this worker's block."""

    steps: dict[str, Callable[[], object]]  # what a step returns is not used
    exchange_s: dict[str, Callable[[], float]]  # the last step's exposed exchange, if known
    engine: Any  # the phalanx contender's Engine
    device: torch.device


def _setup(block: tuple[torch.Tensor, torch.Tensor], cfg: RnnBenchConfig, vocab: int) -> int:
    """Build single (rank 0), ddp and phalanx on fresh copies of the same model."""
    from torch.nn.parallel import DistributedDataParallel

    from phalanx.losses import loss_fn
    from phalanx.pool_training import BlockBatches, PoolTrainConfig

    worker = current_worker()
    layers = cfg.layers(vocab)
    config = PoolTrainConfig(batch_size=cfg.batch_size, seed=0)
    batches = BlockBatches(*block, cfg.batch_size, config)

    def local(module: nn.Module) -> Callable[[], None]:
        optimizer = _sgd(module.parameters())

        def step() -> None:
            x, y = (t.to(worker.device) for t in batches.next())
            optimizer.zero_grad()
            loss_fn(module(x), y).backward()
            optimizer.step()

        return step

    device_ids = [worker.device] if worker.device.type == "cuda" else None
    ddp = DistributedDataParallel(
        _make_model(layers, cfg.seed).to(worker.device), device_ids=device_ids
    )
    engine = Engine(_make_model(layers, cfg.seed), loss_fn, _sgd, context=worker.context)
    steps: dict[str, Callable[[], object]] = {
        "single": local(_make_model(layers, cfg.seed).to(worker.device)),
        "ddp": local(ddp),
        "phalanx": lambda: engine.step(*batches.next()),
    }
    exchange_s = {"phalanx": lambda: engine.stats.exchange_s}
    worker.state.rnn_bench = _Bench(steps, exchange_s, engine, worker.device)
    return sum(p.numel() for p in engine.module.parameters())


def _timed(name: str, steps: int, barrier: bool) -> dict[str, float]:
    """Run ``steps`` steps of contender ``name``; seconds (between barriers when parallel)."""
    worker = current_worker()
    bench: _Bench = worker.state.rnn_bench
    if barrier:
        worker.context.barrier()
    start = time.perf_counter()
    step, stat = bench.steps[name], bench.exchange_s.get(name)
    exchange = []
    for _ in range(steps):
        step()
        if stat is not None:
            exchange.append(stat())
    common.synchronize(bench.device)
    if barrier:
        worker.context.barrier()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "exchange_s": statistics.median(exchange) if exchange else 0.0}


def _teardown() -> None:
    bench = current_worker().state.rnn_bench
    bench.engine.close()
    del current_worker().state.rnn_bench


# -- the controller -----------------------------------------------------------------------------
def run_benchmark(cfg: RnnBenchConfig) -> dict[str, Any]:
    """Start the pool, run warm-up and the alternating rounds, return every number."""
    from phalanx.losses import loss_fn
    from phalanx.pool_training import PoolTrainConfig, PoolTrainer, split_blocks

    started = time.perf_counter()
    data = load_source(DataConfig(source="text", seq_len=cfg.seq_len, val_fraction=0.1))
    layers = cfg.layers(data.num_classes)
    with WorkerPool(cfg.nproc, threads=1, timeout_s=120.0) as pool:
        blocks = split_blocks(data.x_train, data.y_train, cfg.nproc)
        params = pool.run_each(_setup, blocks, cfg, data.num_classes)[0]
        trainer = PoolTrainer(
            pool,
            functools.partial(_make_model, layers, cfg.seed),
            optimizer=_sgd,
            loss_fn=loss_fn,
            config=PoolTrainConfig(batch_size=cfg.batch_size, seed=0),
        )
        trainer.scatter(data.x_train, data.y_train)
        runners = _runners(pool, trainer)
        for name in CONTENDERS:
            if cfg.warmup:
                runners[name](cfg.warmup)
        rounds = [{n: runners[n](cfg.steps) for n in CONTENDERS} for _ in range(cfg.rounds)]
        pool.run(_teardown)
        trainer.close()
        devices = pool.devices
    meta = common.machine_meta(
        devices=devices,
        params=params,
        load_average=common.load_average(),
        wall_s=time.perf_counter() - started,
        config=asdict(cfg),
    )
    return {"meta": meta, "contenders": summarize(rounds, cfg)}


def _runners(pool: Any, trainer: Any) -> dict[str, Callable[[int], dict[str, float]]]:
    """name -> run(steps) -> {"seconds", "exchange_s"} for each contender."""

    def single(steps: int) -> dict[str, float]:
        return pool.run_on(0, _timed, "single", steps, False)

    def in_workers(name: str) -> Callable[[int], dict[str, float]]:
        return lambda steps: pool.run(_timed, name, steps, True)[0]

    def via_pool(steps: int) -> dict[str, float]:
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train(1)
        return {"seconds": time.perf_counter() - start, "exchange_s": 0.0}

    return {"single": single, "ddp": in_workers("ddp"), "phalanx": in_workers("phalanx"),
            "pool": via_pool}  # fmt: skip


def summarize(rounds: list[dict[str, dict[str, float]]], cfg: RnnBenchConfig) -> dict[str, Any]:
    """Per contender: per-round tokens/s, median, speed-up over single and ratio to DDP."""
    out: dict[str, Any] = {}
    for name in CONTENDERS:
        procs = 1 if name == "single" else cfg.nproc
        tokens = cfg.batch_size * cfg.seq_len * procs * cfg.steps
        tps = [tokens / r[name]["seconds"] for r in rounds]
        out[name] = {
            "processes": procs,
            "seconds": [r[name]["seconds"] for r in rounds],
            "tokens_per_s": tps,
            "median_tokens_per_s": statistics.median(tps),
            "median_exchange_s": statistics.median(r[name]["exchange_s"] for r in rounds),
        }
    for name in CONTENDERS[1:]:
        for base, key in (("single", "speedup"), ("ddp", "vs_ddp")):
            if base != name:
                pairs = zip(out[name]["tokens_per_s"], out[base]["tokens_per_s"])
                ratios = [a / b for a, b in pairs]
                out[name][key] = ratios
                out[name][f"median_{key}"] = statistics.median(ratios)
    return out


# -- output -------------------------------------------------------------------------------------
def format_table(result: dict[str, Any]) -> str:
    m, c = result["meta"], result["meta"]["config"]
    header = (
        f"phalanx bench rnn | {m['date']} | torch {m['torch']} | devices {','.join(m['devices'])}"
        f" | cpus {m['cpu_count']} | LSTM {c['embed']}->{c['hidden']}, {m['params']:,} params |"
        f" batch/process {c['batch_size']} x {c['seq_len']} tokens | {c['steps']} steps x "
        f"{c['rounds']} rounds"
    )
    rows = [["contender", "procs", "tokens/s", "per-round range", "vs 1 process", "vs DDP",
             "exch ms/step"]]  # fmt: skip
    for name, r in result["contenders"].items():
        tps = r["tokens_per_s"]
        rows.append([
            name,
            str(r["processes"]),
            f"{r['median_tokens_per_s']:,.0f}",
            f"{min(tps):,.0f} - {max(tps):,.0f}",
            f"{r['median_speedup']:.2f}x" if "median_speedup" in r else "1.00x",
            f"{r['median_vs_ddp']:.2f}x" if "median_vs_ddp" in r else "-",
            f"{r['median_exchange_s'] * 1e3:.2f}" if r["median_exchange_s"] else "-",
        ])  # fmt: skip
    return "\n".join([header, *common.aligned(rows)])


def check(result: dict[str, Any]) -> None:
    for name, r in result["contenders"].items():
        if not all(math.isfinite(v) and v > 0 for v in r["tokens_per_s"]):
            raise WorkerError(0, f"{name}: non-finite or zero tokens/s")


common.register("rnn", "LSTM tokens/s: DDP, Engine, WorkerPool", RnnBenchConfig,
                run_benchmark, check, format_table)  # fmt: skip
