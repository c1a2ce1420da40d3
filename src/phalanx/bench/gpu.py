"""``phalanx bench gpu``: GPT-2 small (124 M parameters) on one GPU, phalanx against the loops a
user writes in plain PyTorch, in one process.

The script: ``phalanx.models.gpt.GPT`` with ``GPT2_SMALL``'s sizes (12 layers, 12 heads, width
768, 1024 tokens of context, 50257 tokens of vocabulary, the head tied to the token embedding),
computing its own loss; AdamW (``fused=True`` on CUDA) with decay (matrices, 0.1) / no-decay
(biases, norms) groups; the gradient norm clipped at 1.0; the forward under bf16 autocast;
``batch_size`` x ``seq_len`` tokens per step (16 x 1024). With ``--device cpu`` the same code
runs a tiny GPT (2 layers, width 64) on a CPU: a smoke test of the path, not a measurement.

Contenders (``--kinds`` x ``--modes``), each with its own copy of the same initial model, in a
world of one joined through phalanx's runtime (``phalanx.init``: NCCL on CUDA, Gloo on a CPU):
  - ``plain``: the loop (zero_grad, forward under autocast, backward, clip_grad_norm_, step);
  - ``ddp``: ``DistributedDataParallel`` and the same loop;
  - ``allreduce``, ``fsdp``: ``Engine(model, optimizer=the same AdamW, exchange=...,
    max_grad_norm=1.0, precision="bf16")``; ``fsdp`` with the blocks as its units;
  - ``fsdp2``: torch's ``fully_shard`` on each block, then on the model, and the same loop;
each ``eager`` and with ``compile``: ``torch.compile`` of the model (plain), of the DDP module
(ddp) or of each block before ``fully_shard`` (fsdp2, as TorchTitan does); ``compile=True`` for
the Engine (each layer's forward). After ``warmup`` steps each (where compiling happens),
``rounds`` rounds run every contender ``steps`` steps, the order rotating each round.

Reported per contender: tokens/s (median over rounds); MFU, by the flop convention of
nanoGPT / PaLM: ``6 N + 12 L H Q T`` flops per token (N the parameters but the position
embedding, L layers, H heads, Q the head width, T the sequence), against ``--peak-tflops``
(989: H100 / H200 dense bf16); memory on CUDA (None on a CPU): the contender's own parameters,
gradients and optimizer state, the high-water mark of its steps above what the process held
before them (``torch.cuda.max_memory_allocated``; every contender's model stays resident) and
their sum; the median per-round ratio of its speed to the plain loop's in the same mode, to
its own eager mode (compiled) and, for ``fsdp``, to ``fsdp2``. Targets, printed PASS or MISS:
``allreduce`` >= 0.98x plain, ``fsdp`` >= 0.95x fsdp2, compiled >= 1.2x eager, the compiled
plain loop >= 35% MFU.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
from torch import nn

import phalanx as px
from phalanx import bench as common
from phalanx.bench.memory_layers import check_device
from phalanx.fields import option
from phalanx.memory.measure import StepPeak
from phalanx.models.gpt import GPT, GPT2_SMALL
from phalanx.runtime.context import RuntimeConfig

KINDS = ("plain", "ddp", "allreduce", "fsdp", "fsdp2")
MODES = ("eager", "compile")
COMPILED = "+compile"  # a compiled contender's name: its kind and this
ENGINE_KINDS = ("allreduce", "fsdp")
UNIT = "TransformerBlock"
TINY = {"vocab_size": 512, "dim": 64, "num_layers": 2, "num_heads": 2, "max_seq_len": 32}
TINY_BATCH = 2
CONVENTION = "6N + 12*L*H*Q*T flops per token (N: parameters but the position embedding)"
TARGETS = (  # (what, contender, the row's key, at least)
    ("allreduce vs the plain loop", "allreduce", "vs_plain", 0.98),
    ("fsdp vs torch's FSDP2 loop", "fsdp", "vs_fsdp2", 0.95),
)


@dataclass(frozen=True, kw_only=True)
class GpuBenchConfig:
    """One ``phalanx bench gpu`` run (recorded in the JSON); sizes left None are GPT-2 small's
    on cuda, a tiny GPT's on a CPU."""

    device: str = option("cuda", "cuda (GPT-2 small), or cpu (a tiny GPT: the same code path)")
    kinds: tuple[str, ...] = option(KINDS, f"the loops and strategies: {', '.join(KINDS)}")
    num_layers: int | None = option(None, "transformer blocks (12; cpu: 2)")
    modes: tuple[str, ...] = option(MODES, "eager, and compile (torch.compile, compile=True)")
    width: int | None = option(None, "model width (768; cpu: 64)")
    num_heads: int | None = option(None, "attention heads (12; cpu: 2)")
    peak_tflops: float = option(989.0, "the device's peak dense bf16 TFLOP/s, for MFU")
    vocab: int | None = option(None, "vocabulary (50257; cpu: 512)")
    seq_len: int | None = option(None, "tokens per sequence (1024; cpu: 32)")
    batch_size: int | None = option(None, "sequences per step (16; cpu: 2)")
    rounds: int = option(3, "alternating rounds")
    warmup: int = option(3, "untimed steps per contender first (the compiled ones compile)")
    steps: int = option(10, "steps per round and contender")

    def validate(self) -> None:
        check_device(self.device)
        common.at_least(self, 1, "num_layers", "width", "num_heads", "vocab", "seq_len")
        common.at_least(self, 1, "batch_size", "rounds", "steps")
        common.at_least(self, 0, "warmup")
        common.at_least(self, 1e-9, "peak_tflops")
        common.known("--kinds", self.kinds, KINDS)
        common.known("--modes", self.modes, MODES)
        self.sizes()  # the width divides among the heads

    def sizes(self) -> dict[str, int]:
        """The model's sizes: the flags given, the rest by device."""
        base = GPT2_SMALL if self.device == "cuda" else TINY
        given = {"vocab_size": self.vocab, "dim": self.width, "num_layers": self.num_layers,
                 "num_heads": self.num_heads, "max_seq_len": self.seq_len}  # fmt: skip
        sizes = {k: base[k] if v is None else v for k, v in given.items()}
        if sizes["dim"] % sizes["num_heads"]:
            raise px.ConfigError(
                f"--width: {sizes['dim']} does not divide among {sizes['num_heads']} heads"
            )
        return sizes

    def batch(self) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return 16 if self.device == "cuda" else TINY_BATCH

    def contenders(self) -> list[str]:
        return [kind + (COMPILED if mode == "compile" else "") for mode in self.modes
                for kind in self.kinds]  # fmt: skip


def flops_per_token(model: GPT, sizes: dict[str, int]) -> float:
    """``6 N + 12 L H Q T`` (the convention of nanoGPT's estimate_mfu and PaLM's appendix)."""
    n = sum(p.numel() for p in model.parameters()) - model.embedding.position.weight.numel()
    heads, width = sizes["num_heads"], sizes["dim"]
    attention = 12 * sizes["num_layers"] * heads * (width // heads) * sizes["max_seq_len"]
    return 6 * n + attention


def adamw(model: nn.Module, device: torch.device) -> torch.optim.AdamW:
    """The script's optimizer: decay on matrices, none on biases and norms; fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), fused=device.type == "cuda")


class _Contender:
    """One way of training the script's model; ``step(ids, targets)`` runs one step."""

    def __init__(self, name: str, model: GPT, ctx: Any) -> None:
        self.kind, compiled = name.removesuffix(COMPILED), name.endswith(COMPILED)
        self.model, self.device = model, ctx.device
        self.engine: px.Engine | None = None
        forward: nn.Module = model
        if self.kind == "fsdp2":
            _fully_shard(model, ctx, compiled)
        elif self.kind == "ddp":
            forward = nn.parallel.DistributedDataParallel(model)
        self.optimizer = adamw(model, ctx.device)  # after fully_shard, as torch says
        if self.kind in ENGINE_KINDS:
            options = {"units": [UNIT]} if self.kind == "fsdp" else {}
            exchange = px.ExchangeConfig(strategy=self.kind, options=options)
            self.engine = px.Engine(model, optimizer=self.optimizer, exchange=exchange,
                                    max_grad_norm=1.0, precision="bf16", compile=compiled,
                                    context=ctx)  # fmt: skip
        elif compiled and self.kind != "fsdp2":
            forward = cast(nn.Module, torch.compile(forward))
        self.forward = forward

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> None:
        if self.engine is not None:
            self.engine.step(ids, targets)
            return
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            _, loss = self.forward(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()

    def held_bytes(self) -> int:
        """Its parameters, gradients and optimizer state (this rank's shards where sharded)."""
        params = list(self.model.parameters())
        held = [*params, *(p.grad for p in params if p.grad is not None)]
        if self.engine is not None:
            return _bytes(held) + self.engine.optimizer_bytes()
        state = [t for s in self.optimizer.state.values() for t in s.values()]
        return _bytes(held + [t for t in state if torch.is_tensor(t)])


def _fully_shard(model: GPT, ctx: Any, compiled: bool) -> None:
    """torch's FSDP2 as its users write it: each block (compiled first, with ``compiled``),
    then the model, which holds the tied embedding and the rest."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)
    for i, block in enumerate(list(model.blocks)):
        unit = cast(nn.Module, torch.compile(block)) if compiled else block
        model.blocks.register_module(str(i), unit)
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _bytes(tensors: list[torch.Tensor]) -> int:
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def _batches(cfg: GpuBenchConfig, vocab: int, count: int, device: torch.device) -> list:
    shape = (count, cfg.batch(), cfg.sizes()["max_seq_len"] + 1)
    ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0))
    return [(x[:, :-1].to(device), x[:, 1:].to(device)) for x in ids]


def _measure(cfg: GpuBenchConfig, ctx: Any) -> dict[str, Any]:
    sizes, names = cfg.sizes(), cfg.contenders()
    torch.manual_seed(0)
    model = GPT(**sizes)
    contenders = {k: _Contender(k, copy.deepcopy(model).to(ctx.device), ctx) for k in names}
    batches = _batches(cfg, sizes["vocab_size"], max(cfg.steps, cfg.warmup), ctx.device)
    warm = {}
    for name, contender in contenders.items():  # the compiled ones compile here
        started = time.perf_counter()
        for ids, targets in batches[: cfg.warmup]:
            contender.step(ids, targets)
        common.synchronize(ctx.device)
        warm[name] = time.perf_counter() - started
        print(f"bench gpu: {name} warmed up in {warm[name]:.1f} s", file=sys.stderr, flush=True)
    seconds: dict[str, list[float]] = {k: [] for k in names}
    peaks: dict[str, int] = dict.fromkeys(names, 0)
    high: dict[str, int] = dict.fromkeys(names, 0)
    for r in range(cfg.rounds):
        for name in common.rotate(names, r):
            contender = contenders[name]
            peak = StepPeak(ctx.device) if ctx.device.type == "cuda" else None

            def steps(contender: _Contender = contender) -> None:
                for ids, targets in batches[: cfg.steps]:
                    contender.step(ids, targets)
                if contender.engine is not None:  # the last step's send-back is its work
                    contender.engine.sync()

            seconds[name].append(common.slowest_s(ctx, steps))
            if peak is not None:
                peaks[name] = max(peaks[name], peak.peak_bytes())
                high[name] = max(high[name], torch.cuda.max_memory_allocated(ctx.device))
    held = {k: c.held_bytes() for k, c in contenders.items()}
    for contender in contenders.values():
        if contender.engine is not None:
            contender.engine.close()
    on_cuda = ctx.device.type == "cuda"
    memory = {k: {"held": held[k], "step_peak": peaks[k], "max_allocated": high[k]} if on_cuda
              else None for k in names}  # fmt: skip
    return {
        "seconds": seconds,
        "memory": memory,
        "warmup_s": warm,
        "flops_per_token": flops_per_token(model, sizes),
    }


def run_benchmark(cfg: GpuBenchConfig) -> dict[str, Any]:
    """Join a world of one (or use the one this process joined, on the same device type), race
    the contenders, leave the world again if this call joined it."""
    import torch.distributed as dist

    started = time.perf_counter()
    joined = not dist.is_initialized()
    ctx = px.init(RuntimeConfig(device="cuda" if cfg.device == "cuda" else "cpu"))
    try:
        if ctx.device.type != cfg.device or ctx.world_size != 1:
            raise px.ConfigError(f"--device {cfg.device}: this process already joined a world "
                                 f"of {ctx.world_size} on {ctx.device}")  # fmt: skip
        measured = _measure(cfg, ctx)
    finally:
        if joined:
            px.shutdown()
    tokens = cfg.batch() * cfg.sizes()["max_seq_len"] * cfg.steps
    device = torch.cuda.get_device_name() if cfg.device == "cuda" else "cpu"
    meta = common.machine_meta(
        wall_s=time.perf_counter() - started, config=asdict(cfg), sizes=cfg.sizes(),
        batch=cfg.batch(), device=device, flops_per_token=measured["flops_per_token"],
        flop_convention=CONVENTION,
    )  # fmt: skip
    return {"meta": meta, "rows": rows(measured, tokens, cfg.peak_tflops)}


def rows(measured: dict[str, Any], tokens: int, peak_tflops: float) -> dict[str, Any]:
    """Each contender's row: tokens/s, MFU, memory (MiB; None on a CPU) and its speed ratios
    (the other's time / its own, the median over rounds)."""
    seconds, memory = measured["seconds"], measured["memory"]
    out: dict[str, Any] = {}
    for name, samples in seconds.items():
        kind = name.removesuffix(COMPILED)
        mode = COMPILED if name != kind else ""
        speed = statistics.median(tokens / s for s in samples)
        row: dict[str, Any] = {
            "tokens_per_s": speed,
            "mfu": speed * measured["flops_per_token"] / (peak_tflops * 1e12),
            "seconds": samples,
            "warmup_s": measured["warmup_s"][name],
            **_memory_mib(memory[name]),
        }
        others = {"vs_plain": "plain" + mode}
        if mode:
            others["vs_eager"] = kind
        if kind == "fsdp":
            others["vs_fsdp2"] = "fsdp2" + mode
        for key, other in others.items():
            if other in seconds:
                row[key] = common.median_ratio(seconds[other], samples)
        out[name] = row
    return out


def _memory_mib(measured: dict[str, int] | None) -> dict[str, float | None]:
    keys = ("held_mib", "step_peak_mib", "peak_mib", "max_allocated_mib")
    if measured is None:  # a CPU: no allocator to read
        return dict.fromkeys(keys)
    held, step = measured["held"], measured["step_peak"]
    values = (held, step, held + step, measured["max_allocated"])
    return {k: v / 2**20 for k, v in zip(keys, values)}


def targets(result: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(what, measured, at least) of every target this run's contenders can show."""
    rows_ = result["rows"]
    found = []
    for name, row in rows_.items():
        kind = name.removesuffix(COMPILED)
        for what, target_kind, key, least in TARGETS:
            if kind == target_kind and key in row:
                found.append((f"{what} ({name})", row[key], least))
        if "vs_eager" in row:
            found.append((f"{name} vs {kind} eager", row["vs_eager"], 1.2))
    if "plain+compile" in rows_:
        found.append(("plain+compile MFU", rows_["plain+compile"]["mfu"], 0.35))
    return found


def check(result: dict[str, Any]) -> None:
    stalled = [name for name, row in result["rows"].items() if not row["tokens_per_s"] > 0]
    if stalled:
        raise RuntimeError(f"no throughput measured for {', '.join(stalled)}")


def format_table(result: dict[str, Any]) -> str:
    """What ran, the table of contenders, then each target: PASS or MISS."""
    table = [("contender", "tokens/s", "MFU", "vs plain", "vs eager", "peak MiB", "held MiB")]
    for name, row in result["rows"].items():
        ratio = [f"{row[k]:.3f}x" if k in row else "" for k in ("vs_plain", "vs_eager")]
        mib = [f"{row[k]:.0f}" if row[k] is not None else "-" for k in ("peak_mib", "held_mib")]
        table.append((name, f"{row['tokens_per_s']:.0f}", f"{100 * row['mfu']:.1f}%", *ratio,
                      *mib))  # fmt: skip
    verdicts = [f"{'PASS' if value >= least else 'MISS'}: {what}: {value:.3f} (target >= "
                f"{least:g})" for what, value, least in targets(result)]  # fmt: skip
    return "\n".join([*_header(result["meta"]), *common.aligned(table), *verdicts])


def _header(meta: dict[str, Any]) -> list[str]:
    cfg, sizes = meta["config"], meta["sizes"]
    model = (f"GPT ({sizes['num_layers']} layers, {sizes['num_heads']} heads, width "
             f"{sizes['dim']}, vocab {sizes['vocab_size']})")  # fmt: skip
    return [
        f"{model} on {meta['device']}, {meta['batch']} x {sizes['max_seq_len']} tokens a step, "
        f"bf16 autocast, AdamW, clip 1.0; medians of {cfg['rounds']} alternating rounds of "
        f"{cfg['steps']} steps",
        f"MFU: {meta['flop_convention']}, {meta['flops_per_token'] / 1e9:.3f} GFLOP per token, "
        f"against {cfg['peak_tflops']:g} TFLOP/s",
    ]


common.register(
    "gpu",
    "GPT-2 small on one GPU: the plain loop, DDP, allreduce, fsdp, FSDP2, eager and compiled",
    GpuBenchConfig,
    run_benchmark,
    check,
    format_table,
)
