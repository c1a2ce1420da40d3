"""AdaGrad in the documents' form (F5): ``lr_i = lr / sqrt(rho + sum_t g_i^2)``, ``rho``
inside the root (torch's Adagrad adds eps outside); foreach ops, whole parameters or flat shards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class AdaGrad(torch.optim.Optimizer):
    """``sum_i += g_i^2``; ``p_i -= lr * g_i / sqrt(rho + sum_i)``; state ``sum`` per parameter."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 0.01,
        rho: float = 1e-8,
        initial_sum: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"AdaGrad lr must be > 0, got {lr}")
        if rho <= 0 and initial_sum <= 0:
            raise ValueError("AdaGrad needs rho > 0 or initial_sum > 0 (else 0/0 at step 1)")
        if weight_decay < 0:
            raise ValueError(f"AdaGrad weight_decay must be >= 0, got {weight_decay}")
        defaults = {"lr": lr, "rho": rho, "initial_sum": initial_sum, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    # torch's stubs type the closure as returning float; real closures return the loss tensor
    def step(  # type: ignore[override]
        self, closure: Callable[[], torch.Tensor] | None = None
    ) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads: list[torch.Tensor] | tuple[torch.Tensor, ...] = [p.grad for p in params]
            sums = [self._sum(p, group["initial_sum"]) for p in params]
            if group["weight_decay"]:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            torch._foreach_addcmul_(sums, grads, grads)
            denominators = torch._foreach_add(sums, group["rho"])
            torch._foreach_sqrt_(denominators)
            torch._foreach_addcdiv_(params, grads, denominators, value=-group["lr"])
        return loss

    def _sum(self, p: torch.Tensor, initial: float) -> torch.Tensor:
        state = self.state[p]
        if "sum" not in state:
            state["sum"] = torch.full_like(p, initial, memory_format=torch.preserve_format)
        return state["sum"]
