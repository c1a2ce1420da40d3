"""The Engine's state for checkpoints: what ``Engine.state_dict`` / ``load_state_dict`` do.

Tensors: the model's as the module holds them (its device and dtypes); the optimizer's per
parameter name, per-element state in the parameter's shape, or as ``phalanx.checkpoint.Slices``
of the flat elements a sharded strategy's rank owns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from phalanx import checkpoint
from phalanx.errors import CheckpointError

if TYPE_CHECKING:
    from phalanx.engine import Engine
    from phalanx.exchange.base import OptimizerSharding


def state_dict(engine: Engine, stored: dict[str, Any] | None = None) -> dict[str, Any]:
    """This rank's part of the Engine's state, as torch.distributed.checkpoint saves it
    (``dcp.save({"engine": engine}, planner=phalanx.checkpoint.SavePlanner())``): the
    model, the optimizer state per parameter name (per-element state in the parameter's
    shape; a sharded strategy's ranks each give only the pieces they own, as
    ``phalanx.checkpoint.Slices``, so no rank gathers the others'), the hyperparameters,
    step counts and precision state. Collective for sharded strategies: call it on every
    rank. ``stored``: the structure of a checkpoint about to be loaded (from
    ``phalanx.checkpoint.restore``); the result then says what this rank reads from it,
    on any world size and strategy."""

    engine.strategy.sync()
    sharding: OptimizerSharding = engine.strategy  # where the optimizer's state lives
    named = {id(p): name for name, p in engine.local_module.named_parameters()}
    names = [named[id(p)] for p in engine.trainable]
    model = engine.local_module.state_dict()  # loads in place: the parameters themselves
    if stored is None:
        lazy = engine.lazy_optimizer_shards()  # state in a tier: read piece by piece
        if lazy is not None:
            shards, groups = lazy
        else:
            with engine.optimizer_resident():  # the returned tensors outlive the block
                shards, groups = sharding.optimizer_shards(engine.optimizer, engine.trainable)
        return {
            "model": model,
            "optimizer": checkpoint.optimizer_to_dcp(shards, groups, engine.trainable, names),
            "num_steps": engine.num_steps,
            "num_updates": engine.num_updates,
            "precision": engine.precision.state_dict(),
        }
    extra = sorted(set(stored.get("model", {})) - set(model))
    if extra and engine.pipeline is None:  # a stage reads its layers only
        raise CheckpointError(f"checkpoint has {extra[0]!r}, which the model does not")
    ranges = sharding.owned_ranges(engine.trainable)
    optimizer = checkpoint.optimizer_template(
        stored.get("optimizer"), ranges, engine.trainable, names
    )
    small = ("num_steps", "num_updates", "precision")
    rest = {k: checkpoint.template(stored[k]) for k in small if k in stored}
    return {"model": model, "optimizer": optimizer, **rest}


def load_state_dict(engine: Engine, state: dict[str, Any]) -> None:
    """Load what ``state_dict`` describes (also the gathered form of earlier versions)."""

    if not isinstance(state, dict) or not {"model", "optimizer"} <= set(state):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"load_state_dict: pass what Engine.state_dict() returned (keys 'model', "
            f"'optimizer', ...); got {got}"
        )
    engine.strategy.sync()
    targets = {
        name: t.data if isinstance(t, torch.nn.Parameter) else t
        for name, t in engine.local_module.state_dict(keep_vars=True).items()
    }
    _check_model_state(state["model"], targets)
    with torch.no_grad():  # in place: parameters may be views of strategy buffers
        for name, value in state["model"].items():
            target = targets[name]
            if value is not target and not _same_storage(target, value):
                target.copy_(value)
    with engine.optimizer_resident():
        _load_optimizer(engine, state["optimizer"])
    engine.num_steps = int(state.get("num_steps", 0))
    engine.num_updates = int(state.get("num_updates", engine.num_steps))
    engine.precision.load_state_dict(state.get("precision") or {})


def _load_optimizer(engine: Engine, optimizer: dict[str, Any]) -> None:
    sharding: OptimizerSharding = engine.strategy
    if any(isinstance(k, int) for k in optimizer.get("state", {})) or (
        optimizer.get("param_groups") and isinstance(optimizer["param_groups"], list)
    ):  # the gathered per-index form (single-file checkpoints)
        sharding.load_optimizer_state_dict(engine.optimizer, engine.trainable, optimizer)
    else:
        named = {id(p): name for name, p in engine.local_module.named_parameters()}
        names = [named[id(p)] for p in engine.trainable]
        shards, groups = checkpoint.optimizer_from_dcp(optimizer, engine.trainable, names)
        sharding.load_optimizer_shards(engine.optimizer, engine.trainable, shards, groups)


def _check_model_state(state: dict[str, Any], targets: dict[str, torch.Tensor]) -> None:
    """The model part of a state must name exactly the model's tensors, in their shapes."""

    extra, missing = sorted(set(state) - set(targets)), sorted(set(targets) - set(state))
    if extra or missing:
        which = f"has {extra[0]!r}, which the model does not" if extra else f"lacks {missing[0]!r}"
        raise CheckpointError(
            f"load_state_dict: the state {which} ({len(extra)} unknown, {len(missing)} missing "
            "tensor(s)); it is from another model"
        )
    for name, value in state.items():
        if not isinstance(value, torch.Tensor) or not isinstance(targets[name], torch.Tensor):
            continue  # a module's extra state: loaded as it is
        if tuple(value.shape) != tuple(targets[name].shape):
            raise CheckpointError(
                f"load_state_dict: {name!r} has shape {tuple(value.shape)} in the state and "
                f"{tuple(targets[name].shape)} in the model; it is from another model"
            )


def _same_storage(target: torch.Tensor, value: Any) -> bool:
    """Whether DCP loaded ``value`` into ``target`` in place (a DTensor: its local rows)."""
    local = getattr(target, "to_local", None)
    t = local() if callable(local) else target
    v = value.to_local() if callable(getattr(value, "to_local", None)) else value
    if not isinstance(v, torch.Tensor):
        return False
    return t.data_ptr() == v.data_ptr() and t.shape == v.shape
