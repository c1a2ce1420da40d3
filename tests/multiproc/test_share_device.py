"""Every strategy on CUDA tensors with two ranks on one GPU (``runtime.share_device``: both
ranks drive cuda:0 over Gloo, since NCCL refuses two ranks on one device): the same parameters
as one process on the global batch, so the CUDA paths (streams, events, pinned copies) run with
more than one rank on a one-GPU machine. Run by ``make test-cuda``."""

from __future__ import annotations

import pytest
import torch

import phalanx as px
from phalanx.runtime.context import RuntimeConfig
from tests.helpers.equivalence import (
    ADAM,
    ReversedNet,
    copy_params,
    global_batches,
    make_engine,
    one_process,
    train_shards,
)
from tests.helpers.spawn import run_ranks

CASES = [  # (name, strategy, options, Engine keywords, tolerance)
    ("allreduce", "allreduce", {}, {}, 1e-5),
    ("allreduce fp16", "allreduce", {}, {"compress": "fp16"}, 2e-2),
    ("tree", "tree", {}, {}, 1e-5),
    ("partitioned cyclic", "partitioned", {"schedule": "cyclic"}, {}, 1e-5),
    ("partitioned native", "partitioned", {"schedule": "native"}, {}, 1e-5),
    ("ps", "ps", {"servers": 0}, {}, 1e-5),
    ("fsdp", "fsdp", {}, {}, 1e-5),
]


def _every_strategy(ctx: px.Context) -> dict[str, float]:
    """Each case's largest parameter difference from one process (on the CPU) on the same
    global batches; the Engine's tensors are on cuda:0."""
    assert ctx.device.type == "cuda" and ctx.backend == "gloo", (ctx.device, ctx.backend)
    torch.manual_seed(0)
    model = ReversedNet()
    batches = global_batches(ctx.world_size)
    reference = [p.detach() for p in one_process(model, ADAM, batches).model.parameters()]
    worst = {}
    for name, strategy, options, keywords, _ in CASES:
        engine = make_engine(ctx, model, ADAM, strategy, options, bucket_mb=0.004, **keywords)
        train_shards(engine, batches)
        got = [p.cpu() for p in copy_params(engine.module)]
        worst[name] = max((g - w).abs().max().item() for g, w in zip(got, reference))
        engine.close()
    return worst


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (two ranks share cuda:0)")
def test_every_strategy_on_cuda_tensors_with_two_ranks_on_one_gpu() -> None:
    runtime = RuntimeConfig(device="cuda", share_device=True, threads=1, timeout_s=120.0)
    results = run_ranks(_every_strategy, 2, runtime=runtime, timeout=300.0)
    tolerance = {name: tol for name, *_, tol in CASES}
    for worst in results:
        assert all(worst[k] < tolerance[k] for k in worst), worst


def test_share_device_refuses_nccl_in_one_line() -> None:
    with pytest.raises(px.ConfigError, match="share_device: NCCL refuses two ranks"):
        RuntimeConfig(share_device=True, backend="nccl")
