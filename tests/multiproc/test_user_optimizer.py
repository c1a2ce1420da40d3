"""A user's training code ported with the fewest changes equals one process: the model's own
``configure_optimizers`` (AdamW, decay / no-decay groups, a custom group key), passed as an
instance, per-group learning rates set by the loop every step, gradient clipping where the
strategy allows it, the model computing its own loss (``(logits, loss)``; a Hugging Face-style
output called with keyword batches) -- every strategy at worlds 2 and 3."""

from __future__ import annotations

import pytest
import torch

import phalanx as px
from tests.helpers.spawn import run_ranks
from tests.multiproc.users_models import GPT, HFStyle, lr_at, tokens

STEPS = 5
GLOBAL_BATCH = 6  # divisible by 2 and 3
STRATEGIES = ["allreduce", "tree", "partitioned", "ps"]


def _gpt_run(world_size: int, rank: int, strategy: str | None) -> dict[str, torch.Tensor]:
    """The user's loop; ``strategy`` None: the plain one-process loop on the global batch.
    Returns the state dict and, as "global losses", each step's loss over the global batch
    (``engine.stats.loss`` under phalanx)."""
    torch.manual_seed(0)
    model = GPT()
    optimizer = model.configure_optimizers(weight_decay=0.1, lr=lr_at(0))
    clip = strategy != "ps"  # ps refuses max_grad_norm (its servers update as buckets arrive)
    engine = None
    if strategy is not None:
        engine = px.Engine(model, optimizer=optimizer, exchange=strategy, bucket_mb=0.002,
                           max_grad_norm=1.0 if clip else None)  # fmt: skip
    per = GLOBAL_BATCH // world_size
    losses = []
    for step in range(STEPS):
        for group in optimizer.param_groups:  # the script's own LR loop, any key
            group["lr"] = lr_at(step) * group.get("lr_scale", 1.0)
        idx, targets = tokens(step, GLOBAL_BATCH)
        if engine is not None:
            engine.step(idx[rank * per : (rank + 1) * per], targets[rank * per : (rank + 1) * per])
            losses.append(engine.stats.loss)  # the mean over every rank
            continue
        optimizer.zero_grad(set_to_none=True)
        loss = model(idx, targets)[1]
        loss.backward()
        losses.append(loss.item())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return {**state, "global losses": torch.tensor(losses, dtype=torch.float64)}


def _hf_run(world_size: int, rank: int, strategy: str | None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = HFStyle()
    optimizer = torch.optim.SGD(
        [{"params": model.embed.parameters(), "lr": 0.05},
         {"params": [*model.body.parameters(), *model.head.parameters()], "momentum": 0.9}],
        lr=0.1,
    )  # fmt: skip
    engine = None if strategy is None else px.Engine(model, optimizer=optimizer, exchange=strategy)
    per = GLOBAL_BATCH // world_size
    for step in range(STEPS):
        idx, labels = tokens(step, GLOBAL_BATCH)
        if engine is not None:
            part = slice(rank * per, (rank + 1) * per)
            engine.step(input_ids=idx[part], labels=labels[part])
            continue
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=idx, labels=labels).loss.backward()
        optimizer.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _all(ctx: px.Context) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for strategy in STRATEGIES:
        out[f"gpt {strategy}"] = _gpt_run(ctx.world_size, ctx.rank, strategy)
        out[f"hf {strategy}"] = _hf_run(ctx.world_size, ctx.rank, strategy)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_users_optimizer_groups_and_own_loss_equal_one_process(world_size: int) -> None:
    results = run_ranks(_all, world_size, timeout=240)
    expected = {"gpt": _gpt_run(world_size, 0, None), "hf": _hf_run(world_size, 0, None)}
    for rank, result in enumerate(results):
        for case, state in result.items():
            reference = expected[case.split()[0]]
            assert state.keys() == reference.keys(), case  # the model's own key names (+ losses)
            for name, value in reference.items():
                torch.testing.assert_close(
                    state[name], value, atol=2e-5, rtol=1e-4,
                    msg=lambda m, c=case, r=rank, n=name: f"{c} rank {r} {n}: {m}",
                )  # fmt: skip
