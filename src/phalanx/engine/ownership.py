"""The user's optimizer, as users write it: an instance over the model's parameters (any number
of parameter groups, any per-group hyperparameters) or a factory ``params -> Optimizer``.

``resolve_optimizer`` turns either into one optimizer over the model's parameters, checked:
whatever a strategy could not honour is refused in one line naming it, never ignored. The
Engine then hands it to the strategy (``Strategy.adopt_optimizer``), which steps it as it is
(``allreduce``, ``tree``) or points its groups at this rank's shards (``partitioned``, ``ps``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx.errors import ConfigError
from phalanx.optim.adagrad import AdaGrad

# Optimizers whose update of an element depends only on that element's gradient and state:
# they give the same result on any flat shard of a parameter as on the whole of it.
ELEMENTWISE: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
    torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.ASGD, AdaGrad,
)  # fmt: skip


def resolve_optimizer(
    spec: Any, params: list[torch.nn.Parameter], *, strategy: str, shards: bool
) -> torch.optim.Optimizer:
    """The optimizer over ``params`` (the model's trainable parameters) that ``spec`` names.

    ``strategy``: its name, for messages; ``shards``: whether it steps flat shards of the
    parameters (an optimizer that is not elementwise is refused; state it already holds is
    split over the shards by the Engine, phalanx.optim.state).
    """
    if isinstance(spec, torch.optim.Optimizer):
        optimizer = spec
        _check_holds_model_parameters(optimizer, params)
    elif callable(spec):
        optimizer = spec(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer: the factory returned {type(optimizer).__name__}, not a "
                "torch.optim.Optimizer; return the optimizer built over the parameters given"
            )
        _check_exactly(optimizer, params)
    else:
        raise ConfigError(
            "optimizer: pass a torch.optim.Optimizer built over the model's parameters or a "
            f"factory params -> Optimizer; got {type(spec).__name__}"
        )
    _check_supported(optimizer, strategy, shards)
    return optimizer


def group_of(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(parameter) -> the index of the optimizer group holding it."""
    return {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}


def _held(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _check_holds_model_parameters(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]
) -> None:
    """An instance may leave some trainable parameters out (they are not updated, as in one
    process); it may not hold tensors the model does not have."""
    known = {id(p) for p in params}
    foreign = [p for p in _held(optimizer) if id(p) not in known and p.requires_grad]
    if foreign:
        raise ConfigError(
            f"optimizer: {type(optimizer).__name__} holds {len(foreign)} tensor(s) that are not "
            f"trainable parameters of the model (first: shape {tuple(foreign[0].shape)}); build "
            "it over this model's parameters (e.g. model.parameters() or its parameter groups)"
        )


def _check_exactly(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    """A factory's optimizer must hold exactly the parameters it was given (one that ignores
    them and builds over other tensors would train something else, silently)."""
    given, held = {id(p) for p in params}, {id(p) for p in _held(optimizer)}
    if given != held:
        extra, missing = len(held - given), len(given - held)
        raise ConfigError(
            f"optimizer: the factory's {type(optimizer).__name__} does not hold exactly the "
            f"parameters it was given ({extra} other tensor(s), {missing} given parameter(s) "
            "left out); build it over the parameters passed in, or pass the optimizer instance"
        )


def _check_supported(optimizer: torch.optim.Optimizer, strategy: str, shards: bool) -> None:
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ConfigError(
            f"optimizer: {name} needs a closure that re-evaluates the loss, which Engine.step "
            "does not take; use an optimizer without one (e.g. Adam, SGD)"
        )
    if not shards:
        return
    if not isinstance(optimizer, ELEMENTWISE):
        known = ", ".join(kind.__name__ for kind in ELEMENTWISE)
        raise ConfigError(
            f"optimizer: {name} is not known to be elementwise, and {strategy!r} steps flat "
            f"shards of the parameters; use one of {known}, or the 'allreduce' or 'tree' "
            "strategy"
        )


OptimizerSpec = torch.optim.Optimizer | Callable[[list[torch.nn.Parameter]], Any]


class TrainableSet:
    """The parameters an Engine exchanges are fixed when it is built (as DDP's reducer's are). A
    parameter that becomes trainable later (progressive unfreezing) or a group added to the
    optimizer would be stepped with each rank's own gradient, and the ranks would drift apart
    with no word: ``check`` refuses either at the next step, in one line naming the fix.

    ``module``: the Engine's model (after any strategy replaced its parameters);
    ``optimizer``: the one the Engine steps. A check costs one attribute read per frozen
    parameter."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        self._optimizer = optimizer
        self._num_groups = len(optimizer.param_groups)

    def check(self, step: int) -> None:
        """Before step number ``step`` (1-based)."""
        if len(self._optimizer.param_groups) != self._num_groups:
            raise ConfigError(
                f"step {step}: a parameter group was added to the optimizer after the Engine was "
                "built, and its gradients would not be exchanged; put every group in the "
                "optimizer before building the Engine (with lr 0 until it should learn)"
            )
        for name, p in self._frozen:
            if p.requires_grad:
                raise ConfigError(
                    f"step {step}: parameter {name!r} became trainable after the Engine was "
                    "built, and its gradient would not be exchanged (each rank would step it "
                    "with its own); make it trainable before building the Engine (with its "
                    "group's lr 0 until it should learn)"
                )


class StepOwnership:
    """The Engine steps the user's optimizer inside ``step()``; a script ported from DDP may
    still call ``optimizer.step()`` after it, which would update every parameter twice (and
    under ``partitioned``/``ps`` only this rank's shards, which then differ from the other
    ranks'). A step pre-hook refuses that call in one line while the Engine is open.

    ``closed``: whether the Engine was closed (the optimizer is the script's again)."""

    def __init__(self, optimizer: torch.optim.Optimizer, closed: Callable[[], bool]) -> None:
        self.inside = False  # set by the Engine around its step
        self._closed = closed
        self._handle = optimizer.register_step_pre_hook(self._check)

    def _check(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.inside and not self._closed():
            raise ConfigError(
                f"{type(optimizer).__name__}.step() called outside engine.step(): the Engine "
                "steps the optimizer itself, so this would update twice; remove "
                "optimizer.step() (and loss.backward(), zero_grad()) from the loop"
            )

    def remove(self) -> None:
        self._handle.remove()
