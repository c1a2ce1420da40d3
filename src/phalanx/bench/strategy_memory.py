"""``phalanx bench strategy-memory``: a user's ResNet-18 script, its peak resident memory per
rank under torch DDP and under each phalanx strategy.

The script: a ResNet-18 written out by hand (torchvision's layout: a 7x7 stem, four stages of
two basic blocks with BatchNorm, global pooling, a linear head; 11.2 M parameters with 10
classes and ``width`` 64), SGD with momentum and weight decay, cross entropy, ``batch_size``
images of ``image_size`` x ``image_size`` per process. Contenders: ``ddp``
(``DistributedDataParallel`` and the script's loop) and the Engine with each strategy
(``Engine(model, loss, optimizer, exchange=...)``).

Each run of a contender is ``nproc`` fresh processes (``run_ranks``: each joins through
``phalanx.init``, DDP's too, so every contender runs on the same heap settings) of ``steps``
steps. Per rank: the peak, the process's VmHWM over the whole run (the model, DDP or the
Engine, every step, bucket rebuilds included) above its VmRSS before the model existed (the
interpreter, torch and phalanx), the kernel's mark reset there; its RSS after the last step;
the bytes of every tensor its Python objects hold then (each storage once: what the contender
keeps, without the heap's free pages); the median step time. ``rounds`` runs per contender,
the order rotating; reported: per rank, the medians, the peak's ratio to DDP's same rank, and
the whole process's VmHWM (torch's libraries included, what a user's ``ru_maxrss`` shows).
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
from phalanx.errors import ConfigError
from phalanx.fields import option
from phalanx.memory import measure

CONTENDERS = ("ddp", "allreduce", "partitioned", "ps")


@dataclass(frozen=True, kw_only=True)
class StrategyMemoryConfig:
    """Everything one ``phalanx bench strategy-memory`` run needs (sent to the ranks)."""

    nproc: int = option(2, "processes")
    width: int = option(64, "channels of the first stage (64: ResNet-18)")
    contenders: tuple[str, ...] = option(CONTENDERS, "ddp and phalanx strategies to run")
    classes: int = option(10, "classes of the head")
    image_size: int = option(64, "image height and width")
    batch_size: int = option(32, "images per process per step")
    steps: int = option(8, "steps per run")
    rounds: int = option(3, "runs per contender, fresh processes each, the order rotating")

    def validate(self) -> None:
        common.at_least(self, 1, *(k for k in asdict(self) if k != "contenders"))
        unknown = sorted(set(self.contenders) - {"ddp", *px.STRATEGIES.names()})
        if unknown or not self.contenders:
            raise ConfigError(
                f"--contenders: {unknown[0] if unknown else 'none given'}; choose from ddp, "
                + ", ".join(px.STRATEGIES.names())
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


def _stepper(kind: str, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: Any) -> Any:
    """One training step of the script under ``kind``, and what to call before measuring."""
    if kind != "ddp":
        engine = px.Engine(model, nn.functional.cross_entropy, optimizer, exchange=kind,
                           context=ctx)  # fmt: skip
        return engine.step, engine.sync
    ddp = nn.parallel.DistributedDataParallel(model, process_group=ctx.group)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()

    return step, lambda: None


def tensor_bytes() -> int:
    """Bytes of every tensor storage this process's Python objects reach (each once)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.layout == torch.strided:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _run(ctx: Any, cfg: StrategyMemoryConfig, kind: str) -> dict[str, float]:
    """One rank's run of ``kind`` (see the module docstring)."""
    gc.collect()
    start = measure.current_rss_bytes()
    exact = measure.reset_peak()
    torch.manual_seed(0)
    model = ResNet18(cfg.width, cfg.classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    step, sync = _stepper(kind, model, optimizer, ctx)
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, generator=g)
    y = torch.randint(0, cfg.classes, (cfg.batch_size,), generator=g)
    seconds = []
    for _ in range(cfg.steps):
        started = time.perf_counter()
        step(x, y)
        seconds.append(time.perf_counter() - started)
    sync()
    return {
        "total": measure.peak_bytes(),
        "peak": measure.peak_bytes() - start,
        "end": measure.current_rss_bytes() - start,
        "held": tensor_bytes(),
        "step_s": statistics.median(seconds[1:] or seconds),
        "params": sum(p.numel() * p.element_size() for p in model.parameters()),
        "exact": float(exact),
    }


def run_benchmark(cfg: StrategyMemoryConfig) -> dict[str, Any]:
    from phalanx.runtime.spawn import run_ranks

    started = time.perf_counter()
    runs: dict[str, list[list[dict[str, float]]]] = {k: [] for k in cfg.contenders}
    for r in range(cfg.rounds):
        for kind in common.rotate(cfg.contenders, r):
            runs[kind].append(run_ranks(_run, cfg.nproc, cfg, kind, timeout=None))
    rows = {kind: _summary(rounds) for kind, rounds in runs.items()}
    if "ddp" in rows:
        for row in rows.values():
            row["vs_ddp"] = [a / b for a, b in zip(row["peak"], rows["ddp"]["peak"])]
            row["total_vs_ddp"] = [a / b for a, b in zip(row["total"], rows["ddp"]["total"])]
    params = runs[cfg.contenders[0]][0][0]["params"]
    meta = common.machine_meta(
        wall_s=time.perf_counter() - started, config=asdict(cfg), param_bytes=params
    )
    return {"meta": meta, "rows": rows, "runs": runs}


def _summary(rounds: list[list[dict[str, float]]]) -> dict[str, list[float]]:
    """Per rank, the median over rounds of each measure."""
    keys = ("total", "peak", "end", "held", "step_s")
    ranks = range(len(rounds[0]))
    return {k: [statistics.median(run[r][k] for run in rounds) for r in ranks] for k in keys}


def check(result: dict[str, Any]) -> None:
    if not all(p > 0 for row in result["rows"].values() for p in row["peak"]):
        raise RuntimeError("a contender's peak could not be read (no /proc here?)")


def format_table(result: dict[str, Any]) -> str:
    cfg, mib = result["meta"]["config"], 2**20
    lines = [
        f"ResNet-18 script (width {cfg['width']}, {result['meta']['param_bytes'] / mib:.1f} MiB "
        f"of parameters), SGD momentum + weight decay, {cfg['batch_size']} x 3 x "
        f"{cfg['image_size']}^2 per process, {cfg['nproc']} processes, {cfg['steps']} steps; "
        f"medians of {cfg['rounds']} runs in fresh processes",
        "MiB per rank (rank 0/rank 1/...): peak: VmHWM above the RSS before the model; whole: "
        "the process's VmHWM; held: tensor bytes after the last step",
        f"{'contender':<12} {'peak':>12} {'vs ddp':>14} {'whole':>12} {'vs ddp':>14} "
        f"{'end RSS':>12} {'held':>12} {'step s':>7}",
    ]
    for kind, row in result["rows"].items():
        ratios = ["/".join(f"{v:.2f}x" for v in row.get(k, [])) for k in ("vs_ddp", "total_vs_ddp")]
        cells = [
            "/".join(f"{v / mib:.0f}" for v in row[k]) for k in ("peak", "total", "end", "held")
        ]
        step_s = statistics.median(row["step_s"])
        lines.append(f"{kind:<12} {cells[0]:>12} {ratios[0]:>14} {cells[1]:>12} {ratios[1]:>14} "
                     f"{cells[2]:>12} {cells[3]:>12} {step_s:>7.2f}")  # fmt: skip
    return "\n".join(lines)


common.register(
    "strategy-memory",
    "a user's ResNet-18 script: peak RSS per rank, DDP vs each strategy",
    StrategyMemoryConfig,
    run_benchmark,
    check,
    format_table,
)
