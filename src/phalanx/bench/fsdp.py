"""``phalanx bench fsdp``: phalanx's ``fsdp`` against torch's own FSDP2 in a hand-written loop,
against DDP, and against ``partitioned`` and ``allreduce``, on one user script (``--model``,
phalanx.bench.fsdp_scripts) in one invocation. Method: docs/bench-methods.md, "fsdp"."""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

import phalanx as px
from phalanx import bench as common
from phalanx.bench.fsdp_scripts import SCRIPTS, Script, Sizes, parameters_of
from phalanx.errors import ConfigError
from phalanx.fields import option
from phalanx.memory.measure import StepPeak

KINDS = ("fsdp2", "fsdp", "partitioned", "allreduce", "tree", "ps", "ddp")
DEFAULT_KINDS = ("fsdp2", "fsdp", "partitioned", "allreduce")
UNIT = "TransformerEncoderLayer"


@dataclass(frozen=True, kw_only=True)
class FsdpBenchConfig:
    """Everything one ``phalanx bench fsdp`` run needs (sent to the ranks)."""

    nproc: int = option(2, "processes")
    model: str = option("gpt", f"the user script: {', '.join(SCRIPTS)}")
    vocab: int = option(2048, "vocabulary (gpt, lora)")
    width: int = option(256, "model width (gpt, lora, mlp)")
    num_layers: int = option(4, "transformer layers (gpt, lora)")
    seq_len: int = option(64, "tokens per sequence (gpt, lora)")
    batch_size: int = option(8, "sequences, images or vectors per process per step")
    contenders: tuple[str, ...] = option(DEFAULT_KINDS, f"which of {', '.join(KINDS)}")
    image_size: int = option(64, "image height and width (resnet)")
    steps: int = option(10, "steps per round and contender")
    rounds: int = option(7, "alternating rounds")
    warmup: int = option(3, "untimed steps per contender first")

    def validate(self) -> None:
        common.at_least(
            self, 1, *(k for k, v in asdict(self).items() if type(v) is int and k != "warmup")
        )
        common.at_least(self, 0, "warmup")
        if self.model not in SCRIPTS:
            raise ConfigError(f"--model: got {self.model!r}; allowed: {', '.join(SCRIPTS)}")
        unknown = [k for k in self.contenders if k not in KINDS]
        if unknown or not self.contenders:
            raise ConfigError(f"--contenders: got {unknown or 'none'}; allowed: {', '.join(KINDS)}")

    def sizes(self) -> Sizes:
        fields = ("vocab", "width", "num_layers", "seq_len", "batch_size", "image_size")
        return Sizes(**{k: getattr(self, k) for k in fields})


class _Contender:
    """One way of training the script's model; ``step(i, inputs, targets)`` runs step i."""

    def __init__(self, kind: str, script: Script, model: nn.Module, ctx: Any) -> None:
        self.kind, self.script, self.model = kind, script, model
        if kind == "fsdp2":
            _fully_shard_by_hand(model, script.unit, ctx)
        self.optimizer = script.optimizer(model)  # after fully_shard, as torch says
        self.ddp = nn.parallel.DistributedDataParallel(model) if kind == "ddp" else None
        self.engine: px.Engine | None = None
        if kind not in ("fsdp2", "ddp"):
            units = kind == "fsdp" and script.unit == UNIT  # FSDP2's units for the GPT
            exchange = px.ExchangeConfig(strategy=kind, options={"units": [UNIT]} if units else {})
            self.engine = px.Engine(model, script.loss_fn, self.optimizer, exchange=exchange,
                                    max_grad_norm=script.clip or None, context=ctx)  # fmt: skip

    def step(self, i: int, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if self.script.lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = self.script.lr(i)
        if self.engine is not None:
            self.engine.step(inputs, targets)
            return
        self.optimizer.zero_grad(set_to_none=True)
        model = self.ddp or self.model
        if self.script.loss_fn is None:
            _, loss = model(inputs, targets)
        else:
            loss = self.script.loss_fn(model(inputs), targets)
        loss.backward()
        if self.script.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.script.clip)
        self.optimizer.step()

    def held_bytes(self) -> int:
        """Parameters, gradients and optimizer state this rank holds (its shards)."""
        params = {id(p): p for p in self.model.parameters()}.values()
        weights = sum(_nbytes(p) + (_nbytes(p.grad) if p.grad is not None else 0) for p in params)
        if self.engine is not None:
            return weights + self.engine.optimizer_bytes()
        state = self.optimizer.state.values()
        return weights + sum(_nbytes(t) for s in state for t in s.values() if torch.is_tensor(t))


def _fully_shard_by_hand(model: nn.Module, unit: str | None, ctx: Any) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)
    if unit is not None:
        units = [m for m in model.modules() if type(m).__name__ == unit]
    else:
        units = [c for c in model.children() if any(True for _ in c.parameters())]
    for layer in units:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _nbytes(t: torch.Tensor) -> int:
    to_local = getattr(t, "to_local", None)
    local = to_local() if callable(to_local) else t
    return local.numel() * local.element_size()


def _timed(ctx: Any, contender: _Contender, cfg: FsdpBenchConfig, first: int) -> float:
    """Seconds per step over ``cfg.steps`` steps, the slowest rank's, between barriers."""
    script, sizes = SCRIPTS[cfg.model], cfg.sizes()
    batches = [script.batch(sizes, first + s, ctx.rank) for s in range(cfg.steps)]
    batches = [(x.to(ctx.device), y.to(ctx.device)) for x, y in batches]

    def steps() -> None:
        for s, (inputs, targets) in enumerate(batches):
            contender.step(first + s, inputs, targets)

    return common.slowest_s(ctx, steps) / cfg.steps


def _in_ranks(ctx: Any, cfg: FsdpBenchConfig) -> dict[str, Any]:
    script, sizes, kinds = SCRIPTS[cfg.model], cfg.sizes(), cfg.contenders
    torch.manual_seed(0)
    model = script.build(sizes).to(ctx.device)
    contenders = {k: _Contender(k, script, copy.deepcopy(model), ctx) for k in kinds}
    for contender in contenders.values():  # warm-up
        for s in range(cfg.warmup):
            contender.step(s, *(t.to(ctx.device) for t in script.batch(sizes, s, ctx.rank)))
    seconds: dict[str, list[float]] = {k: [] for k in kinds}
    peaks: dict[str, list[int]] = {k: [] for k in kinds}
    for r in range(cfg.rounds):
        for k in common.rotate(kinds, r):
            peak = StepPeak(ctx.device)
            seconds[k].append(_timed(ctx, contenders[k], cfg, cfg.warmup + r * cfg.steps))
            peaks[k].append(peak.peak_bytes())
    held = {k: c.held_bytes() for k, c in contenders.items()}
    for contender in contenders.values():
        if contender.engine is not None:
            contender.engine.close()
    return {"seconds": seconds, "held": held, "peak": {k: max(v) for k, v in peaks.items()}}


def run_benchmark(cfg: FsdpBenchConfig) -> dict[str, Any]:
    from phalanx.runtime.spawn import run_ranks

    started = time.perf_counter()
    ranks = run_ranks(_in_ranks, cfg.nproc, cfg, timeout=None)
    seconds = ranks[0]["seconds"]
    rows = {}
    for kind in cfg.contenders:
        row: dict[str, Any] = {
            "step_s": statistics.median(seconds[kind]),
            "seconds": seconds[kind],
            "held_mib": max(r["held"][kind] for r in ranks) / 2**20,
            "step_peak_mib": max(r["peak"][kind] for r in ranks) / 2**20,
        }
        if "fsdp2" in seconds:  # speed against torch's loop: its time / this one's
            row["vs_fsdp2"] = common.median_ratio(seconds["fsdp2"], seconds[kind])
        if "ddp" in seconds:  # cost over DDP: this one's time / DDP's
            row["time_vs_ddp"] = common.median_ratio(seconds[kind], seconds["ddp"])
            row["time_vs_ddp_range"] = common.ratio_iqr(seconds[kind], seconds["ddp"])
        rows[kind] = row
    params, trainable = parameters_of(SCRIPTS[cfg.model].build(cfg.sizes()))
    meta = common.machine_meta(
        wall_s=time.perf_counter() - started,
        config=asdict(cfg),
        parameters=params,
        trainable=trainable,
    )
    return {"meta": meta, "rows": rows}


def check(result: dict[str, Any]) -> None:
    if not all(r["step_s"] > 0 for r in result["rows"].values()):
        raise RuntimeError("a contender measured no step time")


def format_table(result: dict[str, Any]) -> str:
    cfg, meta, rows = result["meta"]["config"], result["meta"], result["rows"]
    ratios = [k for k in ("vs_fsdp2", "time_vs_ddp") if any(k in r for r in rows.values())]
    heads = {"vs_fsdp2": "vs fsdp2", "time_vs_ddp": "time / ddp's"}
    lines = [
        f"{cfg['model']} script ({meta['parameters'] / 1e6:.1f} M parameters, "
        f"{meta['trainable'] / 1e6:.2f} M trainable), {cfg['nproc']} processes; medians of "
        f"{cfg['rounds']} alternating rounds of {cfg['steps']} steps",
        f"{'contender':<12} {'step ms':>8} " + " ".join(f"{heads[k]:>13}" for k in ratios)
        + f" {'held MiB/rank':>14} {'step peak MiB':>14}",
    ]  # fmt: skip
    for kind, row in rows.items():
        cells = " ".join(f"{row[k]:>12.3f}x" for k in ratios)
        lines.append(
            f"{kind:<12} {row['step_s'] * 1e3:>8.1f} {cells} "
            f"{row['held_mib']:>14.1f} {row['step_peak_mib']:>14.1f}"
        )
    if "fsdp" in rows and "vs_fsdp2" in rows["fsdp"]:
        fsdp = rows["fsdp"]["vs_fsdp2"]
        verdict = "PASS" if fsdp >= 0.95 else "MISS"
        lines.append(f"fsdp vs torch's FSDP2 loop: {fsdp:.3f}x ({verdict} >= 0.95)")
    if "fsdp" in rows and "time_vs_ddp" in rows["fsdp"]:
        cost, (lo, hi) = rows["fsdp"]["time_vs_ddp"], rows["fsdp"]["time_vs_ddp_range"]
        verdict = "PASS" if cost <= 1.25 else "MISS"
        lines.append(f"fsdp's step time / DDP's: {cost:.3f}x, rounds {lo:.3f}-{hi:.3f} "
                     f"({verdict} <= 1.25)")  # fmt: skip
    return "\n".join(lines)


common.register("fsdp", "fsdp vs torch's FSDP2 loop vs partitioned vs allreduce",
                FsdpBenchConfig, run_benchmark, check, format_table)  # fmt: skip
