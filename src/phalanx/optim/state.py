"""The user's optimizer state in torch's own format, whatever the strategy: converted to and
from the canonical form (keyed by trainable index), since ``partitioned`` and ``ps`` step shards.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.errors import CheckpointError

# Per optimizer group: its parameters' indices in ``params``, in its order; FROZEN for one
# that is not trainable (a frozen parameter the user left in the group: numbered, no state).
Order = list[list[int]]
FROZEN = -1


def user_order(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> Order:
    """The user's numbering of ``params``, taken before a strategy repoints the groups."""
    index = {id(p): i for i, p in enumerate(params)}
    return [[index.get(id(p), FROZEN) for p in g["params"]] for g in optimizer.param_groups]


def canonical_of(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]
) -> dict[str, Any]:
    """The canonical form of the state an optimizer over the model's parameters holds."""
    index = {id(p): i for i, p in enumerate(params)}
    state = {index[id(p)]: dict(s) for p, s in optimizer.state.items() if id(p) in index and s}
    groups = [_with_params(g, [index[id(p)] for p in g["params"] if id(p) in index])
              for g in optimizer.param_groups]  # fmt: skip
    return {"state": state, "param_groups": groups}


def to_torch_format(canonical: dict[str, Any], order: Order) -> dict[str, Any]:
    """Canonical -> torch's format for the user's optimizer (groups in ``order``)."""
    number: dict[int, int] = {}  # trainable index -> torch's number (FROZEN ones: none)
    groups, first = [], 0
    for group, members in zip(canonical["param_groups"], order):
        ids = list(range(first, first + len(members)))
        first += len(members)
        number.update((i, n) for i, n in zip(members, ids) if i != FROZEN)
        groups.append(_with_params(group, ids))
    state = {number[i]: entry for i, entry in canonical["state"].items() if i in number}
    return {"state": state, "param_groups": groups}


def from_torch_format(state_dict: Any, order: Order) -> dict[str, Any]:
    """Torch's format -> canonical; CheckpointError if it does not fit the user's groups."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise CheckpointError(
            "load_optimizer_state_dict: expected an optimizer state dict ('state', "
            f"'param_groups'), got {type(state_dict).__name__}"
        )
    saved = state_dict["param_groups"]
    sizes, expected = [len(g["params"]) for g in saved], [len(m) for m in order]
    if sizes != expected:
        raise CheckpointError(
            f"load_optimizer_state_dict: the state's parameter groups hold {sizes} parameters, "
            f"the optimizer's {expected}; it is from another model or optimizer"
        )
    index = dict(
        zip([n for g in saved for n in g["params"]], [i for m in order for i in m], strict=True)
    )
    state = {index[n]: e for n, e in state_dict["state"].items() if index.get(n, FROZEN) >= 0}
    groups = [_with_params(g, [i for i in members if i >= 0]) for g, members in zip(saved, order)]
    return {"state": state, "param_groups": groups}


def _with_params(group: dict[str, Any], params: list[int]) -> dict[str, Any]:
    return {**{k: v for k, v in group.items() if k != "params"}, "params": params}


class DirectStateRefused:
    """Replaces ``optimizer.(load_)state_dict`` over shards (silently wrong for a checkpoint)."""

    def __init__(self, method: str, strategy: str) -> None:
        self.method, self.strategy = method, strategy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fix = {
            "state_dict": "call engine.optimizer_state_dict() on every rank (the state of the "
            "optimizer over the whole model, as in one process), then save it from any rank",
            "load_state_dict": "load it before building the Engine (the state is split over "
            "the shards), or call engine.load_optimizer_state_dict(state) on every rank",
        }[self.method]
        raise CheckpointError(
            f"optimizer.{self.method}(): under {self.strategy!r} this rank's optimizer holds "
            f"only its own shards; {fix}"
        )


def refuse_direct_state(optimizer: torch.optim.Optimizer, strategy: str) -> None:
    """Shadow the optimizer's state methods (phalanx calls them through ``load_into``)."""
    for method in ("state_dict", "load_state_dict"):
        setattr(optimizer, method, DirectStateRefused(method, strategy))


def load_into(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, also where ``refuse_direct_state`` hid it."""
    type(optimizer).load_state_dict(optimizer, state)


def state_of(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()``, also where ``refuse_direct_state`` hid it."""
    return type(optimizer).state_dict(optimizer)
