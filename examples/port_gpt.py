"""A typical GPT training script ported to phalanx (README, "Port a training script").

    python examples/port_gpt.py                                  # a world of one
    torchrun --nproc-per-node 2 examples/port_gpt.py partitioned  # any strategy by name
    torchrun --nproc-per-node 2 examples/port_gpt.py ps /tmp/gpt.pt  # where rank 0 saves

The model computes its own loss (``forward(idx, targets) -> (logits, loss)``), builds its own
AdamW with decay / no-decay parameter groups, and the loop sets each group's learning rate and
clips gradients; only rank 0 saves the weights. The lines a DDP script has differently are
marked ``# phalanx``.
"""

from __future__ import annotations

import math
import os
import sys

import torch
from torch import nn

import phalanx as px

VOCAB, WIDTH, SEQ, BATCH = 64, 64, 32, 16
STEPS = int(os.environ.get("STEPS", "60"))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(SEQ, WIDTH)
        layer = nn.TransformerEncoderLayer(
            WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True, bias=False
        )
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # tied input/output embeddings

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        logits = self.lm_head(self.ln_f(self.blocks(x, mask=mask, is_causal=True)))
        if targets is None:
            return logits, None
        return logits, nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))

    def configure_optimizers(self, weight_decay: float, lr: float) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def get_lr(step: int, max_lr: float = 1e-2, warmup: int = 10) -> float:
    if step < warmup:
        return max_lr * (step + 1) / warmup
    return 0.1 * max_lr + 0.45 * max_lr * (1 + math.cos(math.pi * (step - warmup) / STEPS))


def get_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of a repeating token pattern (the model can learn it)."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    idx = (start + torch.arange(SEQ + 1)) % VOCAB
    return idx[:, :-1], idx[:, 1:]


def main() -> None:
    strategy = sys.argv[1] if len(sys.argv) > 1 else "allreduce"
    out = sys.argv[2] if len(sys.argv) > 2 else "gpt.pt"
    ctx = px.init()  # phalanx: instead of init_process_group
    torch.manual_seed(0)
    model = GPT()
    optimizer = model.configure_optimizers(weight_decay=0.1, lr=get_lr(0))
    engine = px.Engine(model, optimizer=optimizer, exchange=strategy,  # phalanx: not DDP(model)
                       max_grad_norm=None if strategy == "ps" else 1.0)  # fmt: skip
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(step)
        loss = engine.step(*get_batch(step, ctx.rank))  # phalanx: forward, backward, step
        if ctx.is_main and step % 20 == 0:
            print(f"step {step}: loss {float(loss):.3f}")
    weights = engine.full_state_dict()  # every rank: whole tensors (fsdp gathers its shards)
    if ctx.is_main:
        torch.save(weights, out)
        print(f"saved {out}")


if __name__ == "__main__":
    main()
