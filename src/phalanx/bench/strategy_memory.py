"""``phalanx bench strategy-memory``: a user's script, its peak memory per rank and its step
time under torch DDP and under each phalanx strategy, at one or more world sizes; beside them,
the formula's optimizer-state bytes per rank, and the targets of ``partitioned`` (issue 46).

The scripts (``--model``): ``resnet``, a ResNet-18 written out by hand (torchvision's layout:
a 7x7 stem, four stages of two basic blocks with BatchNorm, global pooling, a linear head;
11.2 M parameters with 10 classes and ``width`` 64), SGD with momentum and weight decay,
``batch_size`` images of ``image_size`` x ``image_size`` per process; ``mlp``, where the
optimizer state dominates: three Linear layers of ``hidden`` (``MLP``: 33.6 M parameters at
4096) with AdamW, ``batch_size`` vectors per process. Cross entropy in both.
Contenders: ``ddp`` (``DistributedDataParallel`` and the script's loop) and the Engine with
each strategy (``Engine(model, loss, optimizer, exchange=...)``; ``partitioned-native``:
``partitioned`` with ``schedule = "native"``).

Each run of a contender is ``world`` fresh processes (``run_ranks``: each joins through
``phalanx.init``, DDP's too, so every contender runs on the same heap settings) of ``steps``
steps. Per rank: the peak, the process's VmHWM over the whole run (the model, DDP or the
Engine, every step, bucket rebuilds included) above its VmRSS before the model existed (the
interpreter, torch and phalanx), the kernel's mark reset there (on a GPU: the allocator's
``max_memory_allocated`` above what was allocated then); its RSS after the last step; the bytes
of every tensor its Python objects hold then (each storage once: what the contender keeps,
without the heap's free pages); the median step time after the first. ``rounds`` rounds, each
running every world and contender once, the order rotating; reported per world and rank: the
medians, the peak's ratio to DDP's same rank and what it saves, the whole process's VmHWM
(what ``/usr/bin/time`` shows as its maximum resident set), the step time's ratio to DDP's
(median of the per-round ratios, the slowest rank's), and the formula (``formula_state``).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

import phalanx as px
from phalanx import bench as common
from phalanx.bench.port import Verdict, speed_target
from phalanx.errors import ConfigError
from phalanx.exchange.base import ExchangeConfig
from phalanx.exchange.messages import num_partitions
from phalanx.fields import option
from phalanx.memory import measure

CONTENDERS = ("ddp", "allreduce", "partitioned", "partitioned-native", "ps", "fsdp")
# Contenders that are a strategy with options (the rest are a strategy's name, or ddp).
VARIANTS = {"partitioned-native": ("partitioned", {"schedule": "native"})}
MODELS = ("resnet", "mlp")
STATE_PER_PARAM = {"resnet": 1, "mlp": 2}  # SGD momentum: one buffer; AdamW: two moments
MEMORY_SHARE = 0.8  # partitioned's busiest rank below DDP's by 80% of the state's (p-1)/p


@dataclass(frozen=True, kw_only=True)
class StrategyMemoryConfig:
    """Everything one ``phalanx bench strategy-memory`` run needs (sent to the ranks)."""

    worlds: tuple[int, ...] = option((2,), "world sizes (processes), each run every round")
    model: str = option("resnet", "the user script: resnet (SGD) or mlp (AdamW)")
    width: int = option(64, "resnet: channels of the first stage (64: ResNet-18)")
    hidden: int = option(4096, "mlp: width of its three Linear layers (4096: 33.6 M parameters)")
    contenders: tuple[str, ...] = option(CONTENDERS, "ddp and phalanx strategies to run")
    classes: int = option(10, "resnet: classes of the head")
    image_size: int = option(64, "resnet: image height and width")
    batch_size: int = option(32, "images or vectors per process per step")
    steps: int = option(8, "steps per run")
    rounds: int = option(3, "runs per world and contender, fresh processes each, order rotating")

    @property
    def nproc(self) -> int:
        """The most processes at once (``Bench.report``'s oversubscription note)."""
        return max(self.worlds, default=1)

    def validate(self) -> None:
        common.at_least(self, 1, *(k for k in asdict(self) if k not in ("contenders", "worlds",
                                                                        "model")))  # fmt: skip
        common.known("--model", [self.model], MODELS)
        if not self.worlds or min(self.worlds) < 1:
            raise ConfigError(f"--worlds: each must be >= 1, got {self.worlds}")
        allowed = ["ddp", *px.STRATEGIES.names(), *VARIANTS]
        unknown = sorted(set(self.contenders) - set(allowed))
        if unknown or not self.contenders:
            raise ConfigError(
                f"--contenders: {unknown[0] if unknown else 'none given'}; choose from "
                + ", ".join(allowed)
            )


class Block(nn.Module):
    """A basic residual block: two 3x3 convolutions with BatchNorm, a 1x1 projection where
    the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(out + self.down(x))


class ResNet18(nn.Module):
    """The user's model (torchvision's ResNet-18 layout, written out)."""

    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )  # fmt: skip
        blocks, cin = [], width
        for scale, stride in ((1, 1), (2, 2), (4, 2), (8, 2)):
            blocks += [Block(cin, width * scale, stride), Block(width * scale, width * scale, 1)]
            cin = width * scale
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1)
        return self.fc(torch.flatten(features, 1))


class MLP(nn.Sequential):
    """The user's model where the optimizer state dominates: ``layers`` Linear layers, the
    first ``layers - 1`` of ``hidden`` x ``hidden`` with ReLU, then a head of ``classes``
    (``bench fsdp``'s MLP at three layers: 33.6 M parameters at 4096)."""

    def __init__(self, hidden: int, classes: int = 10, layers: int = 3) -> None:
        body = [m for _ in range(layers - 1) for m in (nn.Linear(hidden, hidden), nn.ReLU())]
        super().__init__(*body, nn.Linear(hidden, classes))


def _script(
    cfg: StrategyMemoryConfig, rank: int
) -> tuple[nn.Module, Any, torch.Tensor, torch.Tensor]:
    """The user's model, optimizer and one batch (this rank's), on the CPU."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(rank)
    y = torch.randint(0, cfg.classes, (cfg.batch_size,), generator=g)
    if cfg.model == "mlp":
        model: nn.Module = MLP(cfg.hidden, cfg.classes)
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, optimizer, torch.randn(cfg.batch_size, cfg.hidden, generator=g), y
    model = ResNet18(cfg.width, cfg.classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    x = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, generator=g)
    return model, optimizer, x, y


def _stepper(kind: str, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: Any) -> Any:
    """One training step of the script under ``kind``, what to call before measuring (the last
    step's send-back) and what to call after."""
    if kind != "ddp":
        name, options = VARIANTS.get(kind, (kind, {}))
        exchange = ExchangeConfig(strategy=name, options=options)
        engine = px.Engine(model, nn.functional.cross_entropy, optimizer, exchange=exchange,
                           context=ctx)  # fmt: skip
        return engine.step, engine.sync, engine.close
    on_gpu = ctx.device.type == "cuda"
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[ctx.device] if on_gpu else None, process_group=ctx.group
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()

    return step, lambda: None, lambda: None


def tensor_bytes() -> int:
    """Bytes of every tensor storage this process's Python objects reach (each once)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.layout == torch.strided:
            try:  # a wrapper (a DTensor: its local tensor counts) or a freed FSDP storage
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:
                continue
    return sum(storages.values())


def _run(ctx: Any, cfg: StrategyMemoryConfig, kind: str) -> dict[str, float]:
    """One rank's run of ``kind`` (see the module docstring)."""
    device = ctx.device
    gc.collect()
    common.synchronize(device)
    start = measure.current_bytes(device)
    exact = measure.reset_peak(device)
    model, optimizer, x, y = _script(cfg, ctx.rank)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    model.to(device)  # before the optimizer's first step: its state follows the parameters
    x, y = x.to(device), y.to(device)
    step, sync, close = _stepper(kind, model, optimizer, ctx)
    seconds = []
    for _ in range(cfg.steps):
        started = time.perf_counter()
        step(x, y)
        common.synchronize(device)
        seconds.append(time.perf_counter() - started)
    sync()
    common.synchronize(device)
    peak = measure.peak_bytes(device)
    result = {
        "total": peak if device.type == "cuda" else measure.peak_bytes(),
        "peak": peak - start,
        "end": measure.current_bytes(device) - start,
        "held": tensor_bytes(),
        "step_s": statistics.median(seconds[1:] or seconds),
        "params": params,
        "exact": float(exact),
    }
    close()
    return result


def run_benchmark(cfg: StrategyMemoryConfig) -> dict[str, Any]:
    from phalanx.runtime.spawn import run_ranks

    started = time.perf_counter()
    runs: dict[int, dict[str, list[list[dict[str, float]]]]] = {
        w: {k: [] for k in cfg.contenders} for w in cfg.worlds
    }
    for r in range(cfg.rounds):
        for w in cfg.worlds:
            for kind in common.rotate(cfg.contenders, r):
                runs[w][kind].append(run_ranks(_run, w, cfg, kind, timeout=None))
    params = runs[cfg.worlds[0]][cfg.contenders[0]][0][0]["params"]
    state = STATE_PER_PARAM[cfg.model] * params
    worlds = {str(w): _world(w, runs[w], params, state) for w in cfg.worlds}
    meta = common.machine_meta(wall_s=time.perf_counter() - started, config=asdict(cfg),
                               param_bytes=params, state_bytes=state,
                               load_average=common.load_average())  # fmt: skip
    return {"meta": meta, "worlds": worlds}


def _world(world: int, runs: dict[str, list[list[dict[str, float]]]], params: float,
           state: float) -> dict[str, Any]:  # fmt: skip
    """One world's rows (per contender: per-rank medians, ratios to DDP, the formula) and the
    targets of ``partitioned`` and ``partitioned-native`` (where DDP ran)."""
    rows = {kind: _summary(rounds) for kind, rounds in runs.items()}
    for kind, row in rows.items():
        row["formula_state"] = formula_state(kind, world, state)
        row["formula_saving"] = formula_saving(kind, world, params, state)
    targets = {}
    if "ddp" in rows:
        ddp = rows["ddp"]
        slowest = {k: [max(rank["step_s"] for rank in run) for run in rounds]
                   for k, rounds in runs.items()}  # fmt: skip
        for kind, row in rows.items():
            row["vs_ddp"] = [a / b for a, b in zip(row["peak"], ddp["peak"])]
            row["total_vs_ddp"] = [a / b for a, b in zip(row["total"], ddp["total"])]
            row["saving"] = [b - a for a, b in zip(row["peak"], ddp["peak"])]
            row["step_vs_ddp"] = common.median_ratio(slowest[kind], slowest["ddp"])
        for kind in ("partitioned", "partitioned-native"):
            if kind in rows:
                row = rows[kind]
                memory = memory_target(max(ddp["peak"]), max(row["peak"]), state, world,
                                       max(row["formula_state"]))  # fmt: skip
                speed = speed_target(row["step_vs_ddp"], cyclic=kind == "partitioned")
                targets[kind] = {"memory": memory._asdict(), "speed": speed._asdict()}
    return {"rows": rows, "targets": targets, "runs": runs}


def _summary(rounds: list[list[dict[str, float]]]) -> dict[str, Any]:
    """Per rank, the median over rounds of each measure."""
    keys = ("total", "peak", "end", "held", "step_s")
    ranks = range(len(rounds[0]))
    return {k: [statistics.median(run[r][k] for run in rounds) for r in ranks] for k in keys}


# -- the formula and the targets ----------------------------------------------------------------
def formula_state(kind: str, world: int, state: float) -> list[float]:
    """The optimizer state's bytes on each rank, per docs/exchange.md: the whole on every rank
    (ddp, allreduce, tree); ``partitioned`` cyclic: 1/floor(p/2) on the owners 0, 2, ...,
    2 floor(p/2) - 2, none elsewhere; native, ``ps`` (every rank serves) and ``fsdp``: 1/p."""
    if kind == "partitioned":
        owners = num_partitions(world)
        return [state / owners if r % 2 == 0 and r < 2 * owners else 0.0 for r in range(world)]
    if kind in ("partitioned-native", "ps", "fsdp"):
        return [state / world] * world
    return [state] * world


def formula_saving(kind: str, world: int, params: float, state: float) -> list[float]:
    """What each rank saves against DDP by the formula: the optimizer state it does not keep;
    ``fsdp`` also (p-1)/p of the parameters and of the gradients (a whole-model unit gathers
    every parameter for forward and backward, so its peak keeps less of that)."""
    saving = [state - s for s in formula_state(kind, world, state)]
    if kind == "fsdp":
        saving = [s + 2 * params * (world - 1) / world for s in saving]
    return saving


def memory_target(ddp_peak: float, peak: float, state: float, world: int,
                  formula_busiest: float, share: float = MEMORY_SHARE) -> Verdict:  # fmt: skip
    """PASS where the busiest rank's peak is below DDP's busiest by at least ``share`` of the
    optimizer state's (p-1)/p share (what 1/p of the state would save); a MISS says by how
    much, and why (``formula_busiest``: the formula's state on the busiest rank)."""
    mib = 2**20
    needed, saved = share * state * (world - 1) / world, ddp_peak - peak
    shown = (f"busiest rank {saved / mib:.0f} MiB below DDP's, needed {needed / mib:.0f} MiB "
             f"({share:.0%} of (p-1)/p of {state / mib:.0f} MiB of optimizer state)")  # fmt: skip
    if saved >= needed:
        return Verdict(True, saved, needed, f"PASS: {shown}")
    if state - formula_busiest < needed:
        why = (
            f"by the formula its busiest rank keeps {formula_busiest / state:.0%} of the "
            f"state (cyclic: floor(p/2) = {num_partitions(world)} owner(s) at p = {world})"
        )
    else:
        why = (
            "the formula saves enough: the measured peak keeps more (buffers or heap pages "
            "not returned)"
        )
    return Verdict(False, saved, needed,
                   f"MISS by {(needed - saved) / mib:.0f} MiB: {shown}; why: {why}")  # fmt: skip


def check(result: dict[str, Any]) -> None:
    rows = [row for world in result["worlds"].values() for row in world["rows"].values()]
    if not all(p > 0 for row in rows for p in row["peak"]):
        raise RuntimeError("a contender's peak could not be read (no /proc here?)")


def format_table(result: dict[str, Any]) -> str:
    meta, mib = result["meta"], 2**20
    cfg = meta["config"]
    script = (f"ResNet-18 script (width {cfg['width']}), SGD momentum + weight decay, "
              f"{cfg['batch_size']} x 3 x {cfg['image_size']}^2"
              if cfg["model"] == "resnet" else
              f"MLP script (3 Linear layers of {cfg['hidden']}), AdamW, {cfg['batch_size']} "
              f"vectors")  # fmt: skip
    lines = [
        f"{script} per process, {meta['param_bytes'] / mib:.1f} MiB of parameters, "
        f"{meta['state_bytes'] / mib:.1f} MiB of optimizer state; {cfg['steps']} steps; "
        f"medians of {cfg['rounds']} rounds in fresh processes",
        "MiB per rank (rank 0/rank 1/...): peak: VmHWM above the RSS before the model (on a "
        "GPU: max_memory_allocated); saved: DDP's peak - this; formula: optimizer state kept, "
        "and what it saves (fsdp: parameters and gradients too); whole: the process's VmHWM; "
        "held: tensor bytes after the last step; step: the slowest rank's, median of per-round "
        "ratios to DDP",
    ]
    head = ["contender", "peak", "vs ddp", "saved", "formula state", "formula saved", "whole",
            "held", "step s", "vs ddp"]  # fmt: skip
    for world, data in result["worlds"].items():
        table = [head]
        for kind, row in data["rows"].items():
            cells = ["/".join(f"{v / mib:.0f}" for v in row.get(k, []))
                     for k in ("peak", "saving", "formula_state", "formula_saving", "total",
                               "held")]  # fmt: skip
            ratio = "/".join(f"{v:.2f}x" for v in row.get("vs_ddp", []))
            step = f"{row['step_vs_ddp']:.3f}x" if "step_vs_ddp" in row else ""
            table.append([kind, cells[0], ratio, *cells[1:], f"{max(row['step_s']):.3f}", step])
        lines += [f"world {world}:", *common.aligned(table, "  ")]
        for kind, target in data["targets"].items():
            lines.append(f"  target, {kind}, memory: {target['memory']['text']}")
            lines.append(f"  target, {kind}, speed on this script: {target['speed']['text']} "
                         "(the speed target's own measure: phalanx bench port)")  # fmt: skip
    return "\n".join(lines)


common.register(
    "strategy-memory",
    "a user's ResNet-18 or 30M+ MLP script: peak memory per rank and step time, DDP vs each "
    "strategy, and partitioned's targets",
    StrategyMemoryConfig,
    run_benchmark,
    check,
    format_table,
)
