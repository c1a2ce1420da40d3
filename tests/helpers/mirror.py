"""What the optimizer-state mirror's tests (memory/stream.py, memory/host_mirror.py) train: the
optimizers they step, a small model, and plain torch's training loop whose parameters the
mirrored optimizer must equal bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

CPU = torch.device("cpu")
Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Factory] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "sgd momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 4))


def train(
    net: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    unused: bool = False,
    device: torch.device = CPU,
    seed: int = 1,
) -> list[torch.Tensor]:
    """Plain torch training (mean squared error on seeded batches of 8, in the parameters'
    dtype on ``device``); with ``unused``, ``net[2].weight`` has no gradient on every other
    step. Reads the parameters through ``state_dict`` (which waits for the host mirror's
    pending chunks, as a user's checkpoint would)."""
    g = torch.Generator().manual_seed(seed)
    dtype = next(net.parameters()).dtype
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        x, y = x.to(device, dtype), y.to(device, dtype)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        if unused and step % 2:  # a parameter without gradient this step keeps its state
            net[2].weight.grad = None
        opt.step()
    return [t.detach().clone() for t in net.state_dict().values()]
