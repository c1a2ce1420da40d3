"""``phalanx bench pipeline``: what a pipeline costs, against torch.distributed.pipelining itself:
the same model and split both ways in the same processes, alternating. Method and what is
reported (bubble vs theory, transfers, memory): docs/bench-methods.md, "pipeline"."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import phalanx as px
from phalanx import bench as common
from phalanx.errors import ConfigError
from phalanx.exchange.comm import global_rank
from phalanx.fields import ConfigValueError, option
from phalanx.models.gpt import GPTEmbedding, TransformerBlock
from phalanx.parallel import ParallelConfig
from phalanx.parallel.pipeline import _example, choose_split
from phalanx.parallel.pipeline_schedules import SCHEDULES
from phalanx.runtime.context import RuntimeConfig

VOCAB = 97


@dataclass(frozen=True, kw_only=True)
class PipelineBenchConfig:
    """One ``phalanx bench pipeline`` run (picklable: sent to the workers)."""

    nproc: int = option(2, "pipeline ranks")
    schedules: tuple[str, ...] = option(
        ("gpipe", "1f1b", "interleaved", "interleaved_zb", "zbv", "dualpipev"),
        "pipeline schedules",
    )
    batch_size: int = option(32, "sequences per step")
    seq_len: int = option(64, "tokens per sequence")
    dim: int = option(128, "model width")
    num_blocks: int = option(4, "transformer blocks")
    seed: int = option(0, "weight seed")
    microbatches: tuple[int, ...] = option((2, 4, 8), "micro-batch counts M")
    warmup: int = option(2, "untimed steps first")
    rounds: int = option(10, "timed blocks per side")
    steps: int = option(4, "consecutive steps per block")
    threads: int = option(1, "intra-op threads per process")

    def validate(self) -> None:
        common.at_least(self, 1, "batch_size", "seq_len", "dim", "num_blocks", "rounds", "steps")
        if self.nproc < 2:
            raise ConfigError("--nproc: a pipeline needs at least 2 processes")
        for name in self.schedules:
            if name not in SCHEDULES:
                raise ConfigError(
                    f"--schedules: unknown schedule {name!r}; known: {', '.join(SCHEDULES.names())}"
                )
        for m in self.microbatches:
            if m < 1 or self.batch_size % m:
                raise ConfigError(
                    f"--microbatches: {m} does not split --batch-size {self.batch_size} evenly"
                )

    def cells(self) -> list[tuple[str, int, str]]:
        """(schedule, M, why the schedule refuses it or "") for every cell of the grid."""
        cells = []
        for schedule in self.schedules:
            for m in self.microbatches:
                try:
                    ParallelConfig(pipeline=self.nproc, microbatches=m, schedule=schedule)
                    cells.append((schedule, m, ""))
                except ConfigValueError as e:
                    cells.append((schedule, m, f"{e.key}: {e.reason}"))
        return cells


def gpt_layers(cfg: PipelineBenchConfig) -> list[nn.Module]:
    """The benchmark model, built identically on every rank (same seed)."""

    torch.manual_seed(cfg.seed)
    return [
        GPTEmbedding(VOCAB, cfg.dim, max_seq_len=cfg.seq_len),
        *[TransformerBlock(cfg.dim, num_heads=4) for _ in range(cfg.num_blocks)],
        nn.LayerNorm(cfg.dim),
        nn.Linear(cfg.dim, VOCAB),
    ]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


# -- inside the workers -----------------------------------------------------------------------
def _worker(ctx: Any, cfg: PipelineBenchConfig) -> dict[str, Any] | None:
    torch.manual_seed(cfg.seed + 1)
    x = torch.randint(0, VOCAB, (cfg.batch_size, cfg.seq_len))
    y = torch.randint(0, VOCAB, (cfg.batch_size, cfg.seq_len))
    rows = []
    for schedule, m, refused in cfg.cells():
        if refused:
            rows.append({"schedule": schedule, "microbatches": m, "refused": refused})
        else:
            rows.append(_measure(ctx, cfg, schedule, m, x, y))
    return {"rows": rows} if ctx.rank == 0 else None


def _measure(
    ctx: Any, cfg: PipelineBenchConfig, schedule: str, m: int, x: torch.Tensor, y: torch.Tensor
) -> dict[str, Any]:
    parallel = ParallelConfig(pipeline=cfg.nproc, microbatches=m, schedule=schedule, split="auto")
    layers = gpt_layers(cfg)
    sample = x[: cfg.batch_size // m]
    stage_of, _ = choose_split(
        layers, parallel, ctx, sample
    )  # measured on rank 0, the same for both
    engine = px.Engine(
        nn.Sequential(*layers),
        _loss,
        lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        parallel=parallel,
        stages=stage_of,
        sample_input=sample,
        context=ctx,
    )
    pipeline = engine.pipeline
    assert pipeline is not None
    pipeline.measure_busy = True
    baseline = _TorchPipeline(gpt_layers(cfg), stage_of, parallel, pipeline, sample)
    for _ in range(cfg.warmup):
        engine.step(x, y)
        baseline.step(x, y)
    ours, theirs, bubbles = [], [], []

    passes: dict[str, list[float]] = {}  # pass kind -> [seconds, count] over the timed blocks

    def our_block() -> None:
        busy = 0.0
        for _ in range(cfg.steps):
            engine.step(x, y)
            busy += pipeline.busy_s
            for kind, (seconds, count) in pipeline.busy_by_pass.items():
                total = passes.setdefault(kind, [0.0, 0])
                total[0], total[1] = total[0] + seconds, total[1] + count
        our_busy.append(busy)

    def their_block() -> None:
        for _ in range(cfg.steps):
            baseline.step(x, y)

    our_busy: list[float] = []
    for i in range(cfg.rounds):  # blocks of consecutive steps, alternating which side goes
        first_ours = i % 2 == 0  # first, so drifts in the machine's speed hit both alike
        if not first_ours:
            theirs.append(common.slowest_s(ctx, their_block))
        elapsed = common.slowest_s(ctx, our_block)
        ours.append(elapsed / cfg.steps)
        bubbles.append(_mean_over_ranks(ctx, 1.0 - our_busy[-1] / elapsed))
        if first_ours:
            theirs.append(common.slowest_s(ctx, their_block))
    theirs = [t / cfg.steps for t in theirs]
    local = sum(p.numel() * p.element_size() for p in pipeline.local.parameters())
    total = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
    shares: list[float | None] = [None] * ctx.world_size
    dist.all_gather_object(shares, local / total, group=ctx.group)
    transfer = _transfer_time(ctx, pipeline, m)
    pass_ms = _pass_means(ctx, passes)
    step_s, torch_s = statistics.median(ours), statistics.median(theirs)
    kind = pipeline.kind
    engine.close()
    return {
        "schedule": schedule,
        "microbatches": m,
        "stages": parallel.num_stages,
        "split": stage_of,
        "phalanx_step_s": step_s,
        "torch_step_s": torch_s,
        "throughput_ratio": statistics.median(t / o for t, o in zip(theirs, ours)),
        "bubble_measured": statistics.median(bubbles),
        "bubble_theory": kind.bubble_fraction(cfg.nproc, m, parallel.stages_per_rank),
        "bubble_1f1b": (cfg.nproc - 1) / (m + cfg.nproc - 1),
        "param_share_per_rank": shares,
        "pass_ms": pass_ms,
        "transfer_bytes_per_step": transfer["bytes"],
        "transfer_s_per_step": transfer["seconds"],
        "transfer_share": transfer["seconds"] / step_s,
        "samples": {"phalanx_s": ours, "torch_s": theirs, "bubble": bubbles},
    }


PASS_LETTERS = {"forward": "F", "full": "B", "input": "I", "weight": "W"}


def _pass_means(ctx: Any, passes: dict[str, list[float]]) -> dict[str, float]:
    """Milliseconds per pass of one stage over one micro-batch, by kind (forward, full
    backward, input backward, weight backward), over every rank's stages: the zero-bubble
    claims assume forward = input = weight."""
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, passes, group=ctx.group)
    totals: dict[str, list[float]] = {}
    for rank_passes in gathered:
        for kind, (seconds, count) in rank_passes.items():
            total = totals.setdefault(kind, [0.0, 0])
            total[0], total[1] = total[0] + seconds, total[1] + count
    return {kind: 1e3 * seconds / count for kind, (seconds, count) in totals.items() if count}


def _mean_over_ranks(ctx: Any, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, group=ctx.group)
    return float(t.item()) / ctx.world_size


def _transfer_time(ctx: Any, pipeline: Any, m: int) -> dict[str, float]:
    """Bytes every transfer layer moves per step (activation forward and gradient back, per
    micro-batch) and their time: a ping-pong of the first boundary's activation between
    pipeline ranks 0 and 1 gives one message's time."""
    boundary = pipeline.boundaries[0]
    message = torch.zeros(boundary.shape, dtype=boundary.dtype, device=ctx.device)
    num_messages = 2 * m * pipeline.num_crossings
    repeats, rank = 10, dist.get_rank(pipeline.pipe_group)
    dist.barrier(group=ctx.group)
    start = time.perf_counter()
    for _ in range(repeats):
        if rank == 0:
            dist.send(message, global_rank(pipeline.pipe_group, 1), group=pipeline.pipe_group)
            dist.recv(message, global_rank(pipeline.pipe_group, 1), group=pipeline.pipe_group)
        elif rank == 1:
            dist.recv(message, global_rank(pipeline.pipe_group, 0), group=pipeline.pipe_group)
            dist.send(message, global_rank(pipeline.pipe_group, 0), group=pipeline.pipe_group)
    seconds = (time.perf_counter() - start) / (2 * repeats)
    one_way = torch.tensor([seconds], dtype=torch.float64, device=ctx.device)
    dist.broadcast(one_way, src=0, group=ctx.group)
    nbytes = message.numel() * message.element_size()
    return {"bytes": num_messages * nbytes, "seconds": num_messages * float(one_way.item())}


class _TorchPipeline:
    """The baseline: the same stages and schedule with torch.distributed.pipelining alone."""

    def __init__(
        self,
        layers: list[nn.Module],
        stage_of: list[int],
        parallel: Any,
        reference: Any,
        sample: torch.Tensor,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules as torch_schedules

        device, group = reference.world.device, reference.pipe_group
        stages, params = [], []
        for s in reference.stage_ids:
            module = nn.Sequential(*[layer for i, layer in enumerate(layers) if stage_of[i] == s])
            module.to(device)
            params += list(module.parameters())
            before = reference.sample_meta if s == 0 else reference.boundaries[s - 1]
            after = reference.boundaries[s] if s < len(reference.boundaries) else None
            stages.append(
                PipelineStage(
                    module,
                    s,
                    reference.num_stages,
                    device,
                    input_args=_example(before),
                    output_args=None if after is None else _example(after),
                    group=group,
                )
            )
        cls = getattr(torch_schedules, reference.kind.torch_class)
        target = stages if reference.kind.multi_stage else stages[0]
        self.schedule = cls(target, parallel.num_microbatches, loss_fn=_loss)
        self.optimizer = torch.optim.AdamW(params, lr=1e-3)
        self.first, self.last = reference.holds_first, reference.holds_last

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        args = (x,) if self.first else ()
        self.schedule.step(*args, target=y if self.last else None, losses=[] if self.last else None)
        self.optimizer.step()


# -- in the caller ----------------------------------------------------------------------------
def run_benchmark(cfg: PipelineBenchConfig) -> dict[str, Any]:
    from phalanx.runtime.spawn import run_ranks

    start = time.perf_counter()
    results = run_ranks(
        _worker, cfg.nproc, cfg, timeout=None, runtime=RuntimeConfig(threads=cfg.threads)
    )
    meta = common.machine_meta(nproc=cfg.nproc, wall_s=time.perf_counter() - start,
                        model=f"GPT: {cfg.num_blocks} blocks, dim {cfg.dim}, seq {cfg.seq_len}",
                        batch_size=cfg.batch_size)  # fmt: skip
    return {"meta": meta, "rows": results[0]["rows"]}


def format_report(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        f"pipeline over {meta['nproc']} processes, {meta['model']}, batch {meta['batch_size']}",
        f"{'schedule':<14} {'M':>3} {'phalanx ms':>11} {'torch ms':>9} {'ratio':>6} "
        f"{'bubble':>7} {'theory':>7} {'1F1B':>6} {'params/rank':>12} {'transfer':>16}  "
        "passes (ms per stage and micro-batch)",
    ]
    measured = [r for r in result["rows"] if "refused" not in r]
    for r in result["rows"]:
        if "refused" in r:
            lines.append(f"{r['schedule']:<14} {r['microbatches']:>3} refused: {r['refused']}")
            continue
        share = "/".join(f"{s:.2f}" for s in r["param_share_per_rank"])
        mib, ms = r["transfer_bytes_per_step"] / 2**20, 1e3 * r["transfer_s_per_step"]
        transfer = f"{mib:.1f} MiB {ms:.1f} ms"
        lines.append(
            f"{r['schedule']:<14} {r['microbatches']:>3} {1e3 * r['phalanx_step_s']:>11.1f} "
            f"{1e3 * r['torch_step_s']:>9.1f} {r['throughput_ratio']:>6.3f} "
            f"{100 * r['bubble_measured']:>6.1f}% {100 * r['bubble_theory']:>6.1f}% "
            f"{100 * r['bubble_1f1b']:>5.1f}% {share:>12} {transfer:>16}  {_passes(r['pass_ms'])}"
        )
    lines.append(
        "passes: F forward, B full backward, I input backward, W weight backward (zero-bubble "
        "schedules split B into I and W; torch runs stage 0's W as a full backward)"
    )
    lines.append(
        "bubble: measured; theory: the schedule's own (zero-bubble schedules: their claim with "
        "forward = input backward = weight backward); 1F1B: (P-1)/(M+P-1)"
    )
    if not measured:
        return "\n".join(lines)
    ratios = [r["throughput_ratio"] for r in measured]
    lines.append(
        "ratio: phalanx throughput / torch.distributed.pipelining throughput (median of the "
        "ratios of adjacent blocks of steps)"
    )
    lines.append(
        f"over all cells: median {statistics.median(ratios):.3f}, range "
        f"{min(ratios):.3f}-{max(ratios):.3f}"
    )
    return "\n".join(lines)


def _passes(pass_ms: dict[str, float]) -> str:
    order = [k for k in PASS_LETTERS if k in pass_ms] + sorted(set(pass_ms) - set(PASS_LETTERS))
    return " ".join(f"{PASS_LETTERS.get(k, k)} {pass_ms[k]:.1f}" for k in order)


def check(result: dict[str, Any]) -> None:
    for r in result["rows"]:
        if "refused" not in r and not (r["phalanx_step_s"] > 0 and r["torch_step_s"] > 0):
            raise ConfigError("bench pipeline: a zero step time was measured")


common.register("pipeline", "pipeline schedules vs torch.distributed.pipelining",
                PipelineBenchConfig, run_benchmark, check, format_report)  # fmt: skip
