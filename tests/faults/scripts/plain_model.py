"""The model and data of the plain user script, shared with the test's one-process reference."""

import torch

STEPS = 8
GLOBAL_BATCH = 12  # divisible by world sizes 2, 3 and 4


class TiedNet(torch.nn.Module):
    """Tied weights (the same Linear twice), a parameter no step uses, ReLU between."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(10, 16)
        self.shared = torch.nn.Linear(16, 16)
        self.never = torch.nn.Linear(16, 16)  # unused: its gradient stays empty
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.relu(self.shared(h))
        h = torch.relu(self.shared(h))
        return self.head(h)


def build_model() -> torch.nn.Module:
    return TiedNet()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 10, generator=g), torch.randint(
        0, 5, (GLOBAL_BATCH,), generator=g
    )


def batches(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    per = GLOBAL_BATCH // world_size
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
