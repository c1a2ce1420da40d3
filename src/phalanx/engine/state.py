"""EngineState: the Engine's model and optimizer state, wherever the strategy and the memory
tier keep them: checkpoints (``state_dict`` / ``load_state_dict``, DCP-ready), whole-model
reads and the optimizer's state in torch's format.

Tensors: the model's as the module holds them (its device and dtypes); the optimizer's per
parameter name, per-element state in the parameter's shape, or as ``phalanx.checkpoint.Slices``
of the flat elements a sharded strategy's rank owns.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phalanx import checkpoint
from phalanx.engine.slot import StrategySlot
from phalanx.errors import CheckpointError
from phalanx.exchange.base import OptimizerSharding
from phalanx.memory.residency import OptimizerResidency
from phalanx.optim import state as optimizer_state
from phalanx.precision import Precision


@dataclass(kw_only=True)
class EngineState:
    """Built by the Engine once its optimizer is adopted; reads the strategy through ``slot``.

    ``module``: this rank's model (a pipeline's stages); ``trainable``: its parameters the
    optimizer steps, in the Engine's order; ``mirror``: the optimizer's memory tier or host
    mirror (None: on the device); ``user_order``: the user's numbering of the parameters where
    a sharded strategy re-pointed the optimizer (None: it steps the model's own);
    ``closed``: whether the Engine was closed (nothing left to wait for)."""

    slot: StrategySlot
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    trainable: list[torch.nn.Parameter]
    precision: Precision
    mirror: OptimizerResidency | None
    user_order: Any
    strategy_name: str
    shards_parameters: bool
    stages: bool  # a pipeline's stages: a checkpoint may hold other stages' layers
    world_size: int
    closed: Callable[[], bool]

    def sync(self) -> None:
        """Every parameter holds its updated value (the mirror's, the strategy's send-back)."""
        if self.closed():
            return
        if self.mirror is not None:
            self.mirror.sync()
        self.slot.current.sync()

    def resident(self) -> AbstractContextManager[None]:
        """The whole optimizer state in memory inside the block (it may live in the memory
        tier between steps: ``[memory] optimizer = "host"``)."""
        return nullcontext() if self.mirror is None else self.mirror.resident()

    def lazy_shards(self) -> tuple[dict[int, dict[str, Any]], list[Any]] | None:
        """The optimizer state for a checkpoint that reads it from its memory tier piece by
        piece (``[memory] optimizer = "host"`` on a CPU), or None: ``resident``."""
        return None if self.mirror is None else self.mirror.lazy_shards(self.trainable)

    def optimizer_bytes(self) -> int:
        """Bytes of optimizer state on this rank (in memory, plus in the memory tier)."""
        stored = 0 if self.mirror is None else self.mirror.stored_bytes()
        return self.slot.current.optimizer_bytes(self.optimizer) + stored

    def state_dict(
        self, stored: dict[str, Any] | None, num_steps: int, num_updates: int
    ) -> dict[str, Any]:
        """This rank's part of the Engine's state, as torch.distributed.checkpoint saves it
        (``dcp.save({"engine": engine}, planner=phalanx.checkpoint.SavePlanner())``): the
        model, the optimizer state per parameter name (per-element state in the parameter's
        shape; a sharded strategy's ranks each give only the pieces they own, as
        ``phalanx.checkpoint.Slices``, so no rank gathers the others'), the hyperparameters,
        step counts and precision state. Collective for sharded strategies: call it on every
        rank. ``stored``: the structure of a checkpoint about to be loaded (from
        ``phalanx.checkpoint.restore``); the result then says what this rank reads from it,
        on any world size and strategy."""
        self.slot.current.sync()
        sharding: OptimizerSharding = self.slot.current  # where the optimizer's state lives
        names = self._names()
        model = self.module.state_dict()  # loads in place: the parameters themselves
        if stored is None:
            lazy = self.lazy_shards()  # state in a tier: read piece by piece
            if lazy is not None:
                shards, groups = lazy
            else:
                with self.resident():  # the returned tensors outlive the block
                    shards, groups = sharding.optimizer_shards(self.optimizer, self.trainable)
            return {
                "model": model,
                "optimizer": checkpoint.optimizer_to_dcp(shards, groups, self.trainable, names),
                "num_steps": num_steps,
                "num_updates": num_updates,
                "precision": self.precision.state_dict(),
            }
        extra = sorted(set(stored.get("model", {})) - set(model))
        if extra and not self.stages:  # a stage reads its layers only
            raise CheckpointError(f"checkpoint has {extra[0]!r}, which the model does not")
        ranges = sharding.owned_ranges(self.trainable)
        optimizer = checkpoint.optimizer_template(
            stored.get("optimizer"), ranges, self.trainable, names
        )
        small = ("num_steps", "num_updates", "precision")
        rest = {k: checkpoint.template(stored[k]) for k in small if k in stored}
        return {"model": model, "optimizer": optimizer, **rest}

    def load_state_dict(self, state: dict[str, Any]) -> tuple[int, int]:
        """Load what ``state_dict`` describes (also the gathered form of earlier versions);
        returns the (num_steps, num_updates) it holds."""
        if not isinstance(state, dict) or not {"model", "optimizer"} <= set(state):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(
                f"load_state_dict: pass what Engine.state_dict() returned (keys 'model', "
                f"'optimizer', ...); got {got}"
            )
        self.slot.current.sync()
        targets = {
            name: t.data if isinstance(t, torch.nn.Parameter) else t
            for name, t in self.module.state_dict(keep_vars=True).items()
        }
        _check_model_state(state["model"], targets)
        with torch.no_grad():  # in place: parameters may be views of strategy buffers
            for name, value in state["model"].items():
                target = targets[name]
                if value is not target and not _same_storage(target, value):
                    target.copy_(value)
        with self.resident():
            self._load_optimizer(state["optimizer"])
        self.precision.load_state_dict(state.get("precision") or {})
        num_steps = int(state.get("num_steps", 0))
        return num_steps, int(state.get("num_updates", num_steps))

    def _load_optimizer(self, optimizer: dict[str, Any]) -> None:
        sharding: OptimizerSharding = self.slot.current
        if any(isinstance(k, int) for k in optimizer.get("state", {})) or (
            optimizer.get("param_groups") and isinstance(optimizer["param_groups"], list)
        ):  # the gathered per-index form (single-file checkpoints)
            sharding.load_optimizer_state_dict(self.optimizer, self.trainable, optimizer)
        else:
            shards, groups = checkpoint.optimizer_from_dcp(optimizer, self.trainable, self._names())
            sharding.load_optimizer_shards(self.optimizer, self.trainable, shards, groups)

    def _names(self) -> list[str]:
        """The trainable parameters' names in the module, in the Engine's order."""
        named = {id(p): name for name, p in self.module.named_parameters()}
        return [named[id(p)] for p in self.trainable]

    def full_state_dict(self) -> dict[str, Any]:
        """``model.state_dict()`` as one process gives it (see ``Engine.full_state_dict``)."""
        self._refuse_gather_when_closed("full_state_dict", self.shards_parameters)
        self.sync()
        return self.slot.current.full_state_dict(self.module)

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state in torch's format (see ``Engine.optimizer_state_dict``)."""
        sharded = self.user_order is not None or self.shards_parameters
        self._refuse_gather_when_closed("optimizer_state_dict", sharded)
        strategy = self.slot.current
        strategy.sync()
        try:
            with self.resident():
                state = strategy.optimizer_state_dict(self.optimizer, self.trainable)
        except RuntimeError as e:  # the backend's words for a peer that did not take part
            if self.user_order is None:
                raise
            raise CheckpointError(
                f"optimizer_state_dict: under {self.strategy_name!r} it gathers every rank's "
                "shards, and a rank did not take part (it left or was elsewhere); call it on "
                f"every rank, then save from one ({str(e).splitlines()[0][:160]})"
            ) from e
        if self.user_order is None:  # the optimizer is over the model's own parameters
            return state
        return optimizer_state.to_torch_format(state, self.user_order)

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``optimizer_state_dict`` returns; on every rank."""
        strategy = self.slot.current
        strategy.sync()
        if self.user_order is not None:
            state = optimizer_state.from_torch_format(state, self.user_order)
        with self.resident():
            strategy.load_optimizer_state_dict(self.optimizer, self.trainable, state)

    def _refuse_gather_when_closed(self, what: str, gathers: bool) -> None:
        """A read that ``gathers`` from every rank cannot run once the group is gone."""
        if gathers and self.world_size > 1 and not dist.is_initialized():
            raise CheckpointError(
                f"{what}: under {self.strategy_name!r} it gathers from every rank, and the "
                "process group is gone (dist.destroy_process_group() or phalanx.shutdown() "
                "ran); call it on every rank before that"
            )


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
