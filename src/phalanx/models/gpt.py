"""A small GPT as layer types, so a config can list it and cut it into pipeline stages.

    token ids (B, T) int64 -> gpt_embedding -> (B, T, C) -> transformer_block x N -> (B, T, C)
    -> layernorm -> linear (C -> vocabulary) -> logits (B, T, V)

Each block is pre-norm: x + attention(ln(x)), then x + mlp(ln(x)), with causal attention by
torch's scaled_dot_product_attention (flash or memory-efficient kernels where the device has
them). Every boundary between layers carries one (B, T, C) tensor, so any cut is a valid stage
boundary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.models.layers import LAYERS


@LAYERS.register("gpt_embedding")
class GPTEmbedding(nn.Module):
    """Token plus learned position embedding: (B, T) int64 ids -> (B, T, dim) float."""

    def __init__(
        self, vocab_size: int, dim: int, max_seq_len: int = 256, dropout: float = 0.0
    ) -> None:
        super().__init__()
        if dim <= 0 or vocab_size <= 0 or max_seq_len <= 0:
            raise ValueError("vocab_size, dim and max_seq_len must be > 0")
        self.token = nn.Embedding(vocab_size, dim)
        self.position = nn.Embedding(max_seq_len, dim)
        self.dropout = nn.Dropout(dropout)
        nn.init.normal_(self.token.weight, std=0.02)
        nn.init.normal_(self.position.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq_len = ids.shape[1]
        if seq_len > self.position.num_embeddings:
            raise ValueError(
                f"sequence of {seq_len} tokens is longer than max_seq_len "
                f"{self.position.num_embeddings}"
            )
        positions = torch.arange(seq_len, device=ids.device)
        return self.dropout(self.token(ids) + self.position(positions))


@LAYERS.register("transformer_block")
class TransformerBlock(nn.Module):
    """Pre-norm causal self-attention and MLP: (B, T, dim) -> (B, T, dim)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.dropout = dropout
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (
            z.view(b, t, self.num_heads, c // self.num_heads).transpose(1, 2) for z in (q, k, v)
        )
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.resid_dropout(self.proj(attended.transpose(1, 2).reshape(b, t, c)))
        return x + self.resid_dropout(self.mlp(self.norm2(x)))


# GPT-2 small (124 M parameters with the head tied to the token embedding): ``GPT(**GPT2_SMALL)``
GPT2_SMALL = {"vocab_size": 50257, "dim": 768, "num_layers": 12, "num_heads": 12,
              "max_seq_len": 1024}  # fmt: skip


class GPT(nn.Module):
    """A whole GPT that computes its own loss, as training scripts write it: the layer types
    above (embedding, ``num_layers`` blocks), a final LayerNorm and a bias-free head whose
    weight is the token embedding's (tied, as GPT-2). ``forward(ids)`` returns the logits
    (B, T, vocab); ``forward(ids, targets)`` returns ``(logits, mean cross-entropy loss)``."""

    def __init__(
        self, vocab_size: int, dim: int, num_layers: int, num_heads: int, max_seq_len: int
    ) -> None:
        super().__init__()
        self.embedding = GPTEmbedding(vocab_size, dim, max_seq_len)
        self.blocks = nn.ModuleList(TransformerBlock(dim, num_heads) for _ in range(num_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.embedding.token.weight

    def forward(
        self, ids: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1))
