"""``phalanx bench fsdp``: phalanx's ``fsdp`` against torch's own FSDP2 in a hand-written loop,
and against ``partitioned`` and ``allreduce``, on one GPT script in one invocation.

The script is ``bench port``'s (a GPT computing its own loss, tied embeddings, AdamW decay /
no-decay groups, clipping at 1.0). Contenders, each with its own copy of the same initial
model, in the same ``nproc`` ranks:
  - ``fsdp2``: ``fully_shard`` on each transformer layer, then on the model; the loop a user
    writes (zero_grad, loss.backward, clip_grad_norm_, step);
  - ``fsdp``: ``Engine(model, optimizer=..., exchange=ExchangeConfig(strategy="fsdp",
    options={"units": ["TransformerEncoderLayer"]}))``: the same units;
  - ``partitioned``, ``allreduce``: the Engine with those strategies.
After ``warmup`` steps each, ``rounds`` rounds run the contenders one after another (the order
rotates each round), ``steps`` steps each, timed between barriers (the slowest rank's time).
Per contender and rank: the bytes it holds (parameters, gradients and optimizer state, counted
from the tensors: this rank's shards where sharded), and its steps' peak above what was held
before them (``memory.measure.StepPeak``: the CUDA allocator's, or the resident set's on a CPU).
Reported: median step time, the median per-round ratio to ``fsdp2`` (its time / theirs), and
the largest rank's bytes.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

import phalanx as px
from phalanx.bench import machine_meta
from phalanx.bench.port import GPT, PortBenchConfig, _batch, _lr
from phalanx.errors import ConfigError
from phalanx.fields import option
from phalanx.memory.measure import StepPeak

KINDS = ("fsdp2", "fsdp", "partitioned", "allreduce")
UNIT = "TransformerEncoderLayer"


@dataclass(frozen=True)
class FsdpBenchConfig:
    """Everything one ``phalanx bench fsdp`` run needs (sent to the ranks)."""

    nproc: int = option(2, "processes")
    vocab: int = option(2048, "vocabulary")
    width: int = option(256, "model width")
    num_layers: int = option(4, "transformer layers (the fully_shard units)")
    seq_len: int = option(64, "tokens per sequence")
    batch_size: int = option(8, "sequences per process per step")
    steps: int = option(10, "steps per round and contender")
    rounds: int = option(7, "alternating rounds")
    warmup: int = option(3, "untimed steps per contender first")

    def validate(self) -> None:
        for key, value in asdict(self).items():
            if value < (0 if key == "warmup" else 1):
                raise ConfigError(f"--{key.replace('_', '-')}: must be >= 1, got {value}")

    def model(self) -> PortBenchConfig:
        fields = ("vocab", "width", "num_layers", "seq_len", "batch_size", "steps", "warmup")
        return PortBenchConfig(nproc=self.nproc, **{k: getattr(self, k) for k in fields})


class _Contender:
    """One way of training the script's model; ``step(i, idx, targets)`` runs step i."""

    def __init__(self, kind: str, model: GPT, ctx: Any) -> None:
        self.kind, self.model = kind, model
        if kind == "fsdp2":
            _fully_shard_by_hand(model, ctx)
        self.optimizer = model.configure_optimizers()  # after fully_shard, as torch says
        self.engine: px.Engine | None = None
        if kind != "fsdp2":
            options = {"units": [UNIT]} if kind == "fsdp" else {}
            exchange = px.ExchangeConfig(strategy=kind, options=options)
            self.engine = px.Engine(model, optimizer=self.optimizer, exchange=exchange,
                                    max_grad_norm=1.0, context=ctx)  # fmt: skip

    def step(self, i: int, idx: torch.Tensor, targets: torch.Tensor) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = _lr(i)
        if self.engine is not None:
            self.engine.step(idx, targets)
            return
        self.optimizer.zero_grad(set_to_none=True)
        _, loss = self.model(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()

    def held_bytes(self) -> int:
        """Parameters, gradients and optimizer state this rank holds (its shards)."""
        params = {id(p): p for p in self.model.parameters()}.values()
        weights = sum(_nbytes(p) + (_nbytes(p.grad) if p.grad is not None else 0) for p in params)
        if self.engine is not None:
            return weights + self.engine.optimizer_bytes()
        state = self.optimizer.state.values()
        return weights + sum(_nbytes(t) for s in state for t in s.values() if torch.is_tensor(t))


def _fully_shard_by_hand(model: GPT, ctx: Any) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)
    for layer in model.blocks.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _nbytes(t: torch.Tensor) -> int:
    to_local = getattr(t, "to_local", None)
    local = to_local() if callable(to_local) else t
    return local.numel() * local.element_size()


def _timed(ctx: Any, contender: _Contender, cfg: PortBenchConfig, first: int) -> float:
    """Seconds per step over ``cfg.steps`` steps, the slowest rank's, between barriers."""
    batches = [_batch(cfg, first + s, ctx.rank) for s in range(cfg.steps)]
    batches = [(x.to(ctx.device), y.to(ctx.device)) for x, y in batches]
    dist.barrier(group=ctx.group)
    start = time.perf_counter()
    for s, (idx, targets) in enumerate(batches):
        contender.step(first + s, idx, targets)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=ctx.group)
    return float(seconds.item()) / cfg.steps


def _in_ranks(ctx: Any, cfg: FsdpBenchConfig) -> dict[str, Any]:
    model_cfg = cfg.model()
    torch.manual_seed(0)
    model = GPT(model_cfg).to(ctx.device)
    contenders = {k: _Contender(k, copy.deepcopy(model), ctx) for k in KINDS}
    for contender in contenders.values():  # warm-up
        for s in range(cfg.warmup):
            contender.step(s, *(t.to(ctx.device) for t in _batch(model_cfg, s, ctx.rank)))
    seconds: dict[str, list[float]] = {k: [] for k in KINDS}
    peaks: dict[str, list[int]] = {k: [] for k in KINDS}
    for r in range(cfg.rounds):
        order = KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]
        for k in order:
            peak = StepPeak(ctx.device)
            seconds[k].append(_timed(ctx, contenders[k], model_cfg, cfg.warmup + r * cfg.steps))
            peaks[k].append(peak.peak_bytes())
    held = {k: c.held_bytes() for k, c in contenders.items()}
    for contender in contenders.values():
        if contender.engine is not None:
            contender.engine.close()
    return {"seconds": seconds, "held": held, "peak": {k: max(v) for k, v in peaks.items()}}


def run_benchmark(cfg: FsdpBenchConfig) -> dict[str, Any]:
    from phalanx.runtime.spawn import run_ranks

    cfg.validate()
    started = time.perf_counter()
    ranks = run_ranks(_in_ranks, cfg.nproc, cfg, timeout=None)
    seconds = ranks[0]["seconds"]
    rows = {}
    for kind in KINDS:
        ratios = [b / s for s, b in zip(seconds[kind], seconds["fsdp2"])]
        rows[kind] = {
            "step_s": statistics.median(seconds[kind]),
            "seconds": seconds[kind],
            "vs_fsdp2": statistics.median(ratios),
            "held_mib": max(r["held"][kind] for r in ranks) / 2**20,
            "step_peak_mib": max(r["peak"][kind] for r in ranks) / 2**20,
        }
    params = sum(p.numel() for p in GPT(cfg.model()).parameters())
    meta = {**machine_meta(), "wall_s": time.perf_counter() - started, "config": asdict(cfg),
            "parameters": params}  # fmt: skip
    return {"meta": meta, "rows": rows}


def _check(result: dict[str, Any]) -> None:
    if not all(r["step_s"] > 0 for r in result["rows"].values()):
        raise RuntimeError("a contender measured no step time")


def format_table(result: dict[str, Any]) -> str:
    cfg, meta = result["meta"]["config"], result["meta"]
    lines = [
        f"GPT script ({cfg['num_layers']} layers, width {cfg['width']}, vocab {cfg['vocab']}, "
        f"{meta['parameters'] / 1e6:.1f} M parameters, {cfg['batch_size']} x {cfg['seq_len']} "
        f"tokens per process), AdamW groups, clip 1.0, {cfg['nproc']} processes; medians of "
        f"{cfg['rounds']} alternating rounds of {cfg['steps']} steps",
        f"{'contender':<12} {'step ms':>8} {'vs fsdp2':>9} {'held MiB/rank':>14} "
        f"{'step peak MiB':>14}",
    ]
    for kind, row in result["rows"].items():
        lines.append(
            f"{kind:<12} {row['step_s'] * 1e3:>8.1f} {row['vs_fsdp2']:>8.3f}x "
            f"{row['held_mib']:>14.1f} {row['step_peak_mib']:>14.1f}"
        )
    fsdp = result["rows"]["fsdp"]["vs_fsdp2"]
    lines.append(f"fsdp vs torch's FSDP2 loop: {fsdp:.3f}x ({'PASS' if fsdp >= 0.95 else 'MISS'}"
                 " >= 0.95)")  # fmt: skip
    return "\n".join(lines)
