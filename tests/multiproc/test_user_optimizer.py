"""A user's training code ported with the fewest changes equals one process: the model's own
``configure_optimizers`` (AdamW, decay / no-decay groups, a custom group key), passed as an
instance, per-group learning rates set by the loop every step, gradient clipping where the
strategy allows it, the model computing its own loss (``(logits, loss)``; a Hugging Face-style
output called with keyword batches) -- every strategy at worlds 2 and 3."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import phalanx as px
from tests.helpers.spawn import run_ranks
from tests.multiproc.users_models import GPT, HFStyle, lr_at, tokens

STEPS = 5
GLOBAL_BATCH = 6  # divisible by 2 and 3
STRATEGIES = ["allreduce", "tree", "partitioned", "ps"]
CLIP = 0.05  # below the gradients' norm (about 0.1-0.3 here): clipping acts on every step


def _gpt_run(
    world_size: int, rank: int, strategy: str | None, clip: bool = True, **engine_options: Any
) -> dict[str, torch.Tensor]:
    """The user's loop; ``strategy`` None: the plain one-process loop on the global batch.
    Returns the state dict and, as "global losses", each step's loss over the global batch
    (``engine.stats.loss`` under phalanx)."""
    torch.manual_seed(0)
    model = GPT()
    optimizer = model.configure_optimizers(weight_decay=0.1, lr=lr_at(0))
    clip = clip and strategy != "ps"  # ps refuses it (its servers update as buckets arrive)
    engine = None
    if strategy is not None:
        engine = px.Engine(model, optimizer=optimizer, exchange=strategy, bucket_mb=0.002,
                           max_grad_norm=CLIP if clip else None, **engine_options)  # fmt: skip
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
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP) > CLIP
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


def _count_all_reduces(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and how many ``torch.distributed.all_reduce`` calls it made."""
    calls, original = [], dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        return fn(), len(calls)
    finally:
        dist.all_reduce = original


def _stop_votes(ctx: px.Context, strategy: str) -> torch.Tensor:
    """``stats.stop_requested`` per step when the last rank calls ``request_stop`` before
    step 1 (a SIGTERM's handler): its vote rides in that step's global loss."""
    torch.manual_seed(0)
    model = GPT()
    engine = px.Engine(model, optimizer=model.configure_optimizers(weight_decay=0.1, lr=1e-3),
                       exchange=strategy, max_grad_norm=CLIP)  # fmt: skip
    flags = []
    for step in range(3):
        if step == 1 and ctx.rank == ctx.world_size - 1:
            engine.request_stop()
        engine.step(*tokens(step, 2))
        flags.append(float(engine.stats.stop_requested))
    engine.close()
    return torch.tensor(flags)


def _all(ctx: px.Context) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    # allreduce: the vote in the loss's own all-reduce; partitioned: riding in the verdict's
    out["stop votes"] = {s: _stop_votes(ctx, s) for s in ("allreduce", "partitioned")}
    for strategy in STRATEGIES:
        run = functools.partial(_gpt_run, ctx.world_size, ctx.rank, strategy)
        out[f"gpt {strategy}"], calls = _count_all_reduces(run)
        out[f"gpt {strategy}"]["all-reduces"] = torch.tensor(calls)
        out[f"hf {strategy}"] = _hf_run(ctx.world_size, ctx.rank, strategy)
    # No verdict all-reduce to ride in (no guard, no clipping): the loss travels alone.
    out["gpt partitioned unguarded"] = _gpt_run(
        ctx.world_size, ctx.rank, "partitioned", clip=False, nonfinite=None
    )
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_users_optimizer_groups_and_own_loss_equal_one_process(world_size: int) -> None:
    results = run_ranks(_all, world_size, timeout=240)
    expected = {"gpt": _gpt_run(world_size, 0, None), "hf": _hf_run(world_size, 0, None)}
    unclipped = _gpt_run(world_size, 0, None, clip=False)  # what ps (no clipping) matches
    # The global loss rides in partitioned's verdict all-reduce (one per step, as without the
    # loss); allreduce has no per-step all-reduce of its own besides the buckets and the loss.
    assert results[0]["gpt partitioned"].pop("all-reduces") == STEPS
    for rank, result in enumerate(results):  # every rank sees the last rank's vote
        for strategy, flags in result.pop("stop votes").items():
            assert flags.tolist() == [0.0, 1.0, 1.0], (rank, strategy)
    for rank, result in enumerate(results):
        for case, state in result.items():
            state.pop("all-reduces", None)
            unclipped_case = case in ("gpt ps", "gpt partitioned unguarded")
            reference = unclipped if unclipped_case else expected[case.split()[0]]
            assert state.keys() == reference.keys(), case  # the model's own key names (+ losses)
            for name, value in reference.items():
                torch.testing.assert_close(
                    state[name], value, atol=2e-5, rtol=1e-4,
                    msg=lambda m, c=case, r=rank, n=name: f"{c} rank {r} {n}: {m}",
                )  # fmt: skip


FIRST = 3  # steps saved at world 2; the rest of STEPS run after resuming at world 3
SAVERS, RESUMERS = ["partitioned", "ps"], ["allreduce", "partitioned"]  # pairwise: (saver, resumer)


def _gpt_engine(strategy: str) -> tuple[px.Engine, torch.optim.Optimizer]:
    torch.manual_seed(1)  # other initial weights than the reference: resuming must restore them
    model = GPT()
    optimizer = model.configure_optimizers(weight_decay=0.1, lr=lr_at(0))
    return px.Engine(model, optimizer=optimizer, exchange=strategy, bucket_mb=0.002), optimizer


def _gpt_steps(ctx: px.Context, engine: px.Engine, optimizer, steps: range) -> None:
    per = GLOBAL_BATCH // ctx.world_size
    for step in steps:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step) * group.get("lr_scale", 1.0)
        idx, targets = tokens(step, GLOBAL_BATCH)
        part = slice(ctx.rank * per, (ctx.rank + 1) * per)
        engine.step(idx[part], targets[part])


def _save_groups(ctx: px.Context, root: str) -> None:
    from phalanx import checkpoint

    for strategy in SAVERS:
        torch.manual_seed(0)
        model = GPT()
        optimizer = model.configure_optimizers(weight_decay=0.1, lr=lr_at(0))
        engine = px.Engine(model, optimizer=optimizer, exchange=strategy, bucket_mb=0.002)
        _gpt_steps(ctx, engine, optimizer, range(FIRST))
        checkpoint.save(f"{root}/{strategy}", FIRST, {"engine": engine}, group=ctx.group)
        engine.close()


def _resume_groups(ctx: px.Context, root: str) -> dict[str, dict[str, torch.Tensor]]:
    from phalanx import checkpoint

    out = {}
    for saver, resumer in zip(SAVERS, RESUMERS):
        engine, optimizer = _gpt_engine(resumer)
        checkpoint.restore(f"{root}/{saver}", {"engine": engine}, group=ctx.group)
        groups = [(g["weight_decay"], g.get("lr_scale")) for g in optimizer.param_groups]
        assert groups == [(0.1, None), (0.0, 2.0)], groups  # the groups came back
        _gpt_steps(ctx, engine, optimizer, range(FIRST, STEPS))
        out[f"{saver} -> {resumer}"] = {k: v.clone() for k, v in engine.module.state_dict().items()}
        engine.close()
    return out


def _assert_all_equal(results: list[dict], reference: dict[str, torch.Tensor]) -> None:
    """Every rank's every case's state dict equals ``reference``."""
    for rank, result in enumerate(results):
        for case, state in result.items():
            for name, value in state.items():
                torch.testing.assert_close(
                    value, reference[name], atol=2e-5, rtol=1e-4,
                    msg=lambda m, c=case, r=rank, n=name: f"{c} rank {r} {n}: {m}",
                )  # fmt: skip


@pytest.mark.timeout(300)
def test_grouped_checkpoints_resume_across_strategies_and_worlds(tmp_path) -> None:
    run_ranks(_save_groups, 2, str(tmp_path), timeout=240)
    results = run_ranks(_resume_groups, 3, str(tmp_path), timeout=240)
    reference = _gpt_run(1, 0, None, clip=False)  # the same global batches at every world
    _assert_all_equal(results, reference)


def _save_own_state(ctx: px.Context, root: str) -> dict[str, str]:
    """A nanoGPT-style checkpoint: every rank asks the Engine for the optimizer's state (its
    own ``optimizer.state_dict()`` is refused under the sharding strategies), rank 0 saves."""
    refused = {}
    for strategy in ["allreduce", "partitioned", "ps"]:
        torch.manual_seed(0)
        model = GPT()
        optimizer = model.configure_optimizers(weight_decay=0.1, lr=lr_at(0))
        engine = px.Engine(model, optimizer=optimizer, exchange=strategy, bucket_mb=0.002)
        _gpt_steps(ctx, engine, optimizer, range(FIRST))
        try:
            optimizer.state_dict()
            refused[strategy] = ""
        except px.PhalanxError as e:
            refused[strategy] = str(e)
        state = engine.optimizer_state_dict()  # on every rank: a collective when sharded
        if ctx.rank == 0:
            checkpoint = {"model": engine.module.state_dict(), "optimizer": state}
            torch.save(checkpoint, f"{root}/{strategy}.pt")
        engine.close()
    return refused


def _resume_own_state(ctx: px.Context, root: str) -> dict[str, dict[str, torch.Tensor]]:
    """The script's resume: weights and ``optimizer.load_state_dict`` before the Engine."""
    out = {}
    for saver, resumer in [("partitioned", "allreduce"), ("ps", "partitioned"),
                           ("allreduce", "ps")]:  # fmt: skip
        saved = torch.load(f"{root}/{saver}.pt")
        torch.manual_seed(1)
        model = GPT()
        model.load_state_dict(saved["model"])
        optimizer = model.configure_optimizers(weight_decay=0.1, lr=lr_at(0))
        optimizer.load_state_dict(saved["optimizer"])
        engine = px.Engine(model, optimizer=optimizer, exchange=resumer, bucket_mb=0.002)
        _gpt_steps(ctx, engine, optimizer, range(FIRST, STEPS))
        out[f"{saver} -> {resumer}"] = {k: v.clone() for k, v in engine.module.state_dict().items()}
        engine.close()
    return out


def _one_process_state(steps: int) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT()
    optimizer = model.configure_optimizers(weight_decay=0.1, lr=lr_at(0))
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step) * group.get("lr_scale", 1.0)
        optimizer.zero_grad(set_to_none=True)
        model(*tokens(step, GLOBAL_BATCH))[1].backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.timeout(300)
def test_the_scripts_own_optimizer_checkpoint_equals_one_process(tmp_path) -> None:
    """``engine.optimizer_state_dict()`` is what ``optimizer.state_dict()`` gives in one process
    (torch's format: the groups, their numbering, per-parameter state) under every strategy;
    a script that loads it into its optimizer before building the Engine resumes exactly, at
    another world size and under another strategy."""
    refused = run_ranks(_save_own_state, 2, str(tmp_path), timeout=240)
    for rank_refused in refused:
        assert rank_refused["allreduce"] == ""  # the optimizer over the model's own parameters
        for strategy in ("partitioned", "ps"):
            assert "engine.optimizer_state_dict()" in rank_refused[strategy]
            assert "\n" not in rank_refused[strategy]
    _, optimizer = _one_process_state(FIRST)
    expected = optimizer.state_dict()
    for strategy in ["allreduce", "partitioned", "ps"]:
        got = torch.load(tmp_path / f"{strategy}.pt")["optimizer"]
        assert got["param_groups"] == expected["param_groups"], strategy
        assert got["state"].keys() == expected["state"].keys(), strategy
        for n, entry in expected["state"].items():
            assert got["state"][n].keys() == entry.keys(), (strategy, n)
            for key, value in entry.items():
                where = f"{strategy} parameter {n} {key}"
                torch.testing.assert_close(got["state"][n][key], value, atol=1e-6, rtol=1e-4,
                                           msg=lambda m, w=where: f"{w}: {m}")  # fmt: skip
        model, optimizer = _one_process_state(0)  # and it loads into a plain optimizer
        optimizer.load_state_dict(got)
    results = run_ranks(_resume_own_state, 3, str(tmp_path), timeout=240)
    reference = _gpt_run(1, 0, None, clip=False)
    _assert_all_equal(results, reference)
