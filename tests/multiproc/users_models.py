"""Models as third parties write them, for the tests of users' training code: a GPT whose
``forward(idx, targets)`` returns ``(logits, loss)`` with tied embeddings and its own
``configure_optimizers`` (decay / no-decay groups by dimension), and a Hugging Face-style model
called with keyword batches that returns an output object with ``.loss``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

VOCAB, WIDTH, SEQ = 24, 16, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        # no projection bias: the key bias has no gradient (softmax ignores it), and Adam would
        # turn that zero's rounding noise into updates that differ between runs
        self.attn = nn.MultiheadAttention(WIDTH, 2, bias=False, batch_first=True)
        hidden = 4 * WIDTH
        self.mlp = nn.Sequential(nn.Linear(WIDTH, hidden), nn.GELU(), nn.Linear(hidden, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), diagonal=1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(x)


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # tied

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay: float, lr: float) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr_scale": 2.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


@dataclass
class Output:
    loss: torch.Tensor | None
    logits: torch.Tensor


class HFStyle(nn.Module):
    """Called as ``model(input_ids=..., labels=...)``; returns an object with ``.loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Output:
        logits = self.head(torch.tanh(self.body(self.embed(input_ids))))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
        return Output(loss=loss, logits=logits)


def lr_at(step: int) -> float:
    """A per-step learning-rate rule set on every group by the user's loop (warm-up, decay)."""
    return 3e-3 * min(1.0, (step + 1) / 3) * (0.8**step)


def tokens(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    idx = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    return idx, torch.roll(idx, -1, dims=1)
