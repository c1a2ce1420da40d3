"""The non-finite guard and gradient clipping of one Engine: a step whose loss or gradients
hold inf/NaN on any rank is skipped on every rank alike; ``max_grad_norm`` clips the global
gradient norm as ``torch.nn.utils.clip_grad_norm_`` does; fp16's loss scale follows the verdict.

Phases, as the Engine calls them in a step:
  Phase 2 (``before_exchange``, between the last forward and its backward): a rank whose loss
    is bad poisons its buckets' usage flags, so the verdict travels with the exchange; strategies
    that update while gradients arrive agree here instead, in one 1-element all-reduce.
  Phase 4 (``inspect``, after the exchange): the strategy's common verdict and the global norm;
    clipping and fp16 unscaling in one multiply of the exchanged gradient.
  Phase 5 (``count``, after the update or the skip): counters, one warning, the abort.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from phalanx.errors import ConfigError, NonFiniteError
from phalanx.fields import option, require
from phalanx.precision import Precision

if TYPE_CHECKING:  # annotations only: the guard itself needs nothing of phalanx.exchange
    from phalanx.exchange.base import GradientExchange

logger = logging.getLogger("phalanx")

Combine = Callable[[bool, float | None], tuple[bool, float | None]]  # over pipeline stages


@dataclass(kw_only=True)
class GuardConfig:
    """What a step with inf/NaN does, and gradient clipping (the guard's keys of ``[train]``)."""

    nonfinite: Literal["skip", "abort"] | None = option(
        "skip",
        "a step with inf/NaN loss or gradients: skip its update on every rank, or stop "
        "(None, Python API only: no guard)",
    )
    max_nonfinite: int = option(10, "stop after this many consecutive skipped steps")
    max_grad_norm: float = option(
        0.0, "clip the global gradient norm over all ranks to this (0: no clipping)"
    )

    def __post_init__(self) -> None:
        require(self.max_nonfinite >= 0, "max_nonfinite", f"must be >= 0, got {self.max_nonfinite}")
        require(self.max_grad_norm >= 0, "max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")


class NonfiniteGuard:
    """Skips, counts and clips as ``config`` says, with ``precision``'s loss scale."""

    def __init__(self, config: GuardConfig, precision: Precision) -> None:
        self.nonfinite, self.max_nonfinite = config.nonfinite, config.max_nonfinite
        self.max_grad_norm = config.max_grad_norm or None  # None: no clipping
        self.precision = precision
        self.grad_norm = float("nan")  # the last step's global gradient norm (with clipping)
        self.num_nonfinite_steps = 0  # steps skipped over the run
        self.consecutive_nonfinite = 0

    @property
    def inspects(self) -> bool:
        """Whether ``inspect`` asks the strategy for a verdict (and so may all-reduce)."""
        return self.nonfinite is not None or self.max_grad_norm is not None or self.precision.scaled

    def agrees_before_backward(self, strategy: GradientExchange) -> bool:
        """Whether ``before_exchange`` holds every rank in one all-reduce between the last
        forward and its backward (a synchronisation the step's trace shows)."""
        return self.nonfinite is not None and strategy.updates_during_exchange

    # Phase 2
    def before_exchange(
        self, loss: torch.Tensor, strategy: GradientExchange, buckets: Any, group: Any
    ) -> bool:
        """Poison this rank's buckets if its loss (0-dim, on the device) is inf/NaN, or agree
        with every rank of ``group`` first where the strategy updates during the exchange;
        returns whether the exchange must be skipped."""
        if self.nonfinite is None:
            return False
        local_bad = strategy.is_trainer and not bool(torch.isfinite(loss))
        if not strategy.updates_during_exchange:
            buckets.poison = local_bad
            strategy.local_loss_bad = local_bad
            return False
        flag = torch.tensor([float(local_bad)], device=loss.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    # Phase 4
    def inspect(
        self,
        strategy: GradientExchange,
        riders: torch.Tensor | None,
        combine: Combine | None,
        mirror: Any,
    ) -> bool:
        """The strategy's verdict on the exchanged gradients and, with ``max_grad_norm``, their
        global norm, clipped; ``riders`` (float64, on the device) are summed in the verdict's
        all-reduce where the strategy makes one; ``combine`` sums a pipeline's stages; a
        ``mirror`` holding copied gradients is scaled alike. Returns whether to skip the step."""
        if not self.inspects:
            return False
        want_norm = self.max_grad_norm is not None
        bad, norm = strategy.inspect_gradients(want_norm, riders)
        if combine is not None:
            bad, norm = combine(bad, norm)
        factor = 1.0 / self.precision.scale  # fp16: unscale (1 otherwise)
        if norm is not None and self.max_grad_norm is not None:
            self.grad_norm = norm * factor
            factor *= min(1.0, self.max_grad_norm / (self.grad_norm + 1e-6))
        if not bad and factor != 1.0:
            strategy.scale_gradients(factor)
            if mirror is not None:  # gradients it copied already get the same factor
                mirror.scale_gradients(factor)
        self.precision.update(overflow=bad)
        return bad and (self.nonfinite is not None or self.precision.scaled)

    # Phase 5
    def count(
        self, skipped: bool, params: Sequence[torch.Tensor], step: int, is_main: bool
    ) -> None:
        """After step number ``step`` (1-based): a skipped step drops ``params``' gradients,
        is said once (rank 0) and stops the run after too many in a row."""
        if not skipped:
            self.consecutive_nonfinite = 0
            return
        self.num_nonfinite_steps += 1
        self.consecutive_nonfinite += 1
        for p in params:
            p.grad = None
        if is_main:  # the verdict is the same on every rank: say it once
            scale = (
                f"; fp16 loss scale now {self.precision.scale:g}" if self.precision.scaled else ""
            )
            logger.warning("phalanx: step %d: inf/NaN loss or gradients, update skipped%s",
                           step, scale)  # fmt: skip
        if self.nonfinite == "abort" or self.consecutive_nonfinite > self.max_nonfinite:
            raise NonFiniteError(
                f"step {step}: loss or gradients are inf/NaN"
                + (
                    f" for {self.consecutive_nonfinite} consecutive steps (max_nonfinite = "
                    f"{self.max_nonfinite})"
                    if self.nonfinite == "skip"
                    else " (nonfinite = 'abort')"
                )
            )


def rescaling_problem(
    updates_during_exchange: bool,
    who: str,
    *,
    max_grad_norm: float | None,
    precision: str,
    nonfinite: str | None,
) -> tuple[str, str] | None:
    """(key, reason) when these options cannot work together, else None. Clipping and fp16
    unscaling need the whole gradient before the update; the Engine and the CLI (which checks
    before starting workers, naming ``who``) share this rule."""
    if max_grad_norm and updates_during_exchange:
        reason = "updates parameters while gradients still arrive, before their global norm exists"
        return "max_grad_norm", f"{who} {reason}; use another strategy"
    if precision == "fp16" and updates_during_exchange:
        return "precision", (
            f"fp16 needs its loss scale removed before the update, which {who} starts while "
            "gradients still arrive; use bf16 or another strategy"
        )
    if precision == "fp16" and nonfinite == "abort":
        return "nonfinite", (
            "'abort' with precision fp16 would stop at the loss scale's first overflow; use "
            "'skip' (max_nonfinite still bounds consecutive skips)"
        )
    return None


def check_rescaling(strategy: type, guard: NonfiniteGuard, precision: Precision) -> None:
    """The Engine's use of ``rescaling_problem``: one line when ``strategy`` (a Strategy class)
    cannot honour the guard's clipping or fp16's unscaling."""
    problem = rescaling_problem(
        strategy.updates_during_exchange,  # type: ignore[attr-defined]
        strategy.__name__,
        max_grad_norm=guard.max_grad_norm,
        precision=precision.name,
        nonfinite=guard.nonfinite,
    )
    if problem is not None:
        raise ConfigError(f"{problem[0]}: {problem[1]}")
