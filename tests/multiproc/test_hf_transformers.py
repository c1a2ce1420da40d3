"""A real Hugging Face model (transformers' GPT2LMHeadModel, built from a config: nothing is
downloaded) trained the way its users train it: keyword batches (``input_ids``, ``labels``),
the model's own loss in ``output.loss``, tied input/output embeddings, decay / no-decay
parameter groups. Every strategy (fsdp with the model's blocks as units) at worlds 2 and 3
equals one process on the global batch.

The library is an optional extra (``pip install "phalanx[hf]"``); without it this file skips."""

from __future__ import annotations

import pytest
import torch

import phalanx as px
from tests.helpers.spawn import run_ranks

transformers = pytest.importorskip(
    "transformers", reason="the optional Hugging Face extra: pip install 'phalanx[hf]'"
)

STEPS = 4
GLOBAL_BATCH = 6  # sequences; divisible by 2 and 3
SEQ, VOCAB = 12, 48
STRATEGIES = ["allreduce", "tree", "partitioned", "ps", "fsdp"]
# fsdp's units are the model's own blocks (the policy a user writes for a third-party model)
EXCHANGE = {"fsdp": px.ExchangeConfig(strategy="fsdp", options={"units": ["GPT2Block"]})}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """As a Hugging Face Trainer groups them: no decay on biases and LayerNorm weights. SGD with
    momentum (Adam would turn the attention key bias's zero gradient, rounding noise, into
    updates that differ between runs)."""
    params = [p for p in model.parameters() if p.requires_grad]  # the tied embedding once
    no_decay = {id(p) for n, p in model.named_parameters() if "bias" in n or "ln_" in n}
    return torch.optim.SGD(
        [{"params": [p for p in params if id(p) not in no_decay], "weight_decay": 0.01},
         {"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0}],
        lr=0.1, momentum=0.9,
    )  # fmt: skip


def _ids(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def _train(world_size: int, rank: int, strategy: str | None) -> dict[str, torch.Tensor]:
    model = _model()
    optimizer = _optimizer(model)
    exchange = EXCHANGE.get(strategy or "", strategy)
    engine = None if strategy is None else px.Engine(model, optimizer=optimizer, exchange=exchange)
    per = GLOBAL_BATCH // world_size
    for step in range(STEPS):
        ids = _ids(step)
        if engine is not None:
            mine = ids[rank * per : (rank + 1) * per]
            engine.step(input_ids=mine, labels=mine)  # as `trainer`-style loops call it
            continue
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    state = model.state_dict() if engine is None else engine.full_state_dict()  # every rank
    return {k: v.clone() for k, v in state.items()}


def _all(ctx: px.Context) -> dict[str, dict[str, torch.Tensor]]:
    return {s: _train(ctx.world_size, ctx.rank, s) for s in STRATEGIES}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_hugging_face_gpt2_equals_one_process(world_size: int) -> None:
    results = run_ranks(_all, world_size, timeout=240)
    expected = _train(world_size, 0, None)
    tied = ("lm_head.weight", "transformer.wte.weight")
    for rank, result in enumerate(results):
        for strategy, state in result.items():
            assert state.keys() == expected.keys(), strategy  # the model's own key names
            assert torch.equal(state[tied[0]], state[tied[1]]), strategy  # still one tensor
            for name, value in expected.items():
                torch.testing.assert_close(
                    state[name], value, atol=2e-5, rtol=1e-4,
                    msg=lambda m, s=strategy, r=rank, n=name: f"{s} rank {r} {n}: {m}",
                )  # fmt: skip
