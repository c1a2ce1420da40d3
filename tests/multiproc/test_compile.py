"""``compile = True`` (torch.compile per layer) trains every strategy to the parameters of one
eager process: world 2, Adam; owner strategies (whose forward pre-hooks wait for parameters) with
nested layers, accumulation, the memory manager's offloaded and recomputed layers and the host
mirror; a 2-stage pipeline; bf16 against the same run eager. One spawned run for all of it:
compiling is slow on a CPU, so the model is tiny, its layers of few kinds and the steps few."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.exchange import strategy_factory
from phalanx.memory.manager import MemoryConfig, MemoryManager
from phalanx.parallel.layout import ParallelConfig
from tests.helpers.equivalence import (
    ADAM,
    LOCAL_BATCH,
    copy_state,
    global_batches,
    max_diff,
    one_process,
    train_shards,
)
from tests.helpers.spawn import run_ranks

STEPS = 3
STRATEGIES = [
    ("allreduce", {}),
    ("tree", {}),
    ("partitioned", {"schedule": "cyclic"}),
    ("ps", {"servers": 0, "reduce": "star"}),
    ("ps", {"servers": 1, "reduce": "tree"}),  # rank 1 serves: rank 0 trains alone
    ("fsdp", {}),
]


class Block(nn.Module):
    """A layer with parameters in its children: inside a compiled layer they wait as one."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), Block(), Block(), nn.Linear(32, 10))


def _data(workers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return global_batches(workers, steps=STEPS, seed=1)


def _eager(batches: list, accumulate: int = 1) -> dict[str, torch.Tensor]:
    """One eager process on the global batches."""
    return one_process(_model(), ADAM, batches, accumulate=accumulate).state()


def _state_after(engine: px.Engine, batches: list, micro: int = 1) -> dict[str, torch.Tensor]:
    """Each trainer's part of the global batches; the state dict this rank holds."""
    train_shards(engine, batches, local_batch=LOCAL_BATCH * micro, sync=False)
    state = copy_state(engine)  # fsdp: a collective
    engine.close()
    return state


def _run(ctx: px.Context) -> dict[str, Any]:
    import torch._dynamo

    out: dict[str, Any] = {"diffs": {}, "compiled": {}, "compile_s": []}
    for name, options in STRATEGIES:
        engine = px.Engine(
            _model(), nn.functional.cross_entropy, ADAM, exchange=strategy_factory(name, options),
            bucket_mb=0.004, context=ctx, compile=True,
        )  # fmt: skip
        batches = _data(engine.data_world_size)
        trains, key = engine.is_trainer, f"{name} {options}"
        out["compiled"][key] = len(engine.compiled)
        state = _state_after(engine, batches)
        out["compile_s"].append(engine.compile_s)
        if trains:
            out["diffs"][key] = max_diff(state, _eager(batches))
    # Owner updates with accumulation, offloaded and recomputed layers and the host mirror.
    model = _model()
    config = MemoryConfig(offload=["1"], recompute=["2"], optimizer="mirror")
    memory = MemoryManager.build(list(model), config, ctx.device)
    engine = px.Engine(
        model, nn.functional.cross_entropy, ADAM, exchange="partitioned", bucket_mb=0.004,
        context=ctx, memory=memory, accumulate_steps=2, compile=True,
    )  # fmt: skip
    batches, offloader = _data(2 * ctx.world_size), memory.offloader
    offloader.min_bytes = 0  # the tiny layer's activations move too
    state = _state_after(engine, batches, micro=2)
    out["offloaded"] = offloader.stats.tensors  # the last step's
    out["diffs"]["partitioned memory accumulate"] = max_diff(state, _eager(batches, 2))
    # Two pipeline stages (one replica): each rank compares the layers it holds.
    engine = px.Engine(
        _model(), nn.functional.cross_entropy, ADAM, exchange="allreduce", bucket_mb=0.004,
        context=ctx, parallel=ParallelConfig(pipeline=2, microbatches=2), stages=[0, 0, 1, 1],
        sample_input=torch.zeros(LOCAL_BATCH // 2, 20), compile=True,
    )  # fmt: skip
    batches = _data(1)
    out["diffs"]["pipeline 2"] = max_diff(_state_after(engine, batches), _eager(batches))
    # bf16 against the same run eager (the reference above is fp32).
    bf16 = {}
    for compiled in (False, True):
        engine = px.Engine(
            _model(), nn.functional.cross_entropy, ADAM, context=ctx, precision="bf16",
            compile=compiled,
        )  # fmt: skip
        bf16[compiled] = _state_after(engine, _data(ctx.world_size))
    out["bf16"] = max_diff(bf16[True], bf16[False])
    out["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    out["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return out


def test_compiled_layers_train_like_one_eager_process() -> None:
    results = run_ranks(_run, 2, timeout=300)
    for rank, r in enumerate(results):
        expected = len(STRATEGIES) + 2 - (rank == 1)  # ps with a server: rank 1 trains nothing
        assert len(r["diffs"]) == expected, (rank, sorted(r["diffs"]))
        for key, diff in r["diffs"].items():
            assert diff < 2e-5, f"rank {rank} {key}: max diff {diff}"
        assert r["bf16"] < 2e-2, (rank, r["bf16"])
        assert all(n == 4 for n in r["compiled"].values()), (rank, r["compiled"])
        assert r["offloaded"] > 0, rank  # the offloaded layer's activations did move
        # The hooks stayed outside the compiled code, and it is compiled code that ran.
        assert r["graph_breaks"] == 0, (rank, r["graph_breaks"])
        assert r["graphs"] > 0, rank
        # torch compiled in the first Engine's steps (its clock saw it).
        assert r["compile_s"][0] > 0, (rank, r["compile_s"])


def _on_gpu(ctx: px.Context) -> dict[str, float]:
    """World 1 on this GPU: compiled layers (inductor's GPU kernels) against eager, under
    allreduce and fsdp."""
    assert ctx.device.type == "cuda", ctx.device
    batches = [(x.to(ctx.device), y.to(ctx.device)) for x, y in _data(1)]
    diffs = {}
    for strategy in ("allreduce", "fsdp"):
        states = []
        for compiled in (False, True):
            engine = px.Engine(_model(), nn.functional.cross_entropy, ADAM, exchange=strategy,
                               context=ctx, compile=compiled)  # fmt: skip
            states.append(_state_after(engine, batches))
        diffs[strategy] = max_diff(states[1], states[0])
    return diffs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (inductor's GPU kernels)")
def test_compiled_layers_on_a_gpu_train_like_eager() -> None:
    (diffs,) = run_ranks(_on_gpu, 1, timeout=300)
    assert all(d < 1e-4 for d in diffs.values()), diffs
