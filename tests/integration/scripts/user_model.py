"""A third-party-style model and its data, shared by the user scripts and the tests' reference.

The model has what real models bring: tied input/output embeddings, a layer no step uses, and
BatchNorm buffers (running statistics that each rank updates from its own shard).
"""

import torch
from torch import nn

STEPS = 6
GLOBAL_BATCH = 12  # divisible by world sizes 2, 3 and 4
VOCAB, WIDTH, SEQ = 32, 16, 5


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)  # BatchNorm follows: no bias
        self.norm = nn.BatchNorm1d(WIDTH)
        self.unused = nn.Linear(WIDTH, WIDTH)  # never called: its gradient stays empty
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2 and most LMs do

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx).mean(dim=1)  # (batch, WIDTH)
        return self.head(torch.relu(self.norm(self.proj(h))))  # (batch, VOCAB)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyLM()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return idx, torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=g)


def shard(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    per = GLOBAL_BATCH // world_size
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def reference(world_size: int) -> dict[str, torch.Tensor]:
    """One process training on the same global batches with Adam, as data parallelism does
    it: BatchNorm normalizes each rank's shard with that shard's statistics (the gradient is
    the mean of the shards'), and the running statistics are rank 0's (phalanx broadcasts
    rank 0's buffers each step, and rank 0 is the one that saves)."""
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        rank0_buffers = None
        for rank in range(world_size):
            x, y = shard(step, rank, world_size)
            loss = nn.functional.cross_entropy(model(x), y) / world_size
            loss.backward()
            if rank == 0:
                rank0_buffers = {k: v.clone() for k, v in model.named_buffers()}
        for name, value in model.named_buffers():
            value.copy_(rank0_buffers[name])
        optimizer.step()
    return model.state_dict()
