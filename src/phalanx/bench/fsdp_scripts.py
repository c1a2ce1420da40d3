"""The training scripts ``phalanx bench fsdp`` runs (``--model``: ``gpt``, ``resnet``, ``lora``,
``mlp``), each as a user writes it: its model, its optimizer, its batches and its loss
(docs/bench-methods.md, "fsdp")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from phalanx.bench.port import GPT, PortBenchConfig, _batch, _lr
from phalanx.bench.strategy_memory import ResNet18

LORA_RANK, LORA_ALPHA = 8, 16
CLASSES = 1000


@dataclass(frozen=True)
class Sizes:
    """The sizes every script reads what it needs from."""

    vocab: int
    width: int
    num_layers: int
    seq_len: int
    batch_size: int
    image_size: int


@dataclass(frozen=True)
class Script:
    """One user script: ``build(sizes)`` the model; ``optimizer(model)``; ``batch(sizes, step,
    rank)`` the step's (inputs, targets); ``loss_fn`` None when the model computes its own
    loss from (inputs, targets); ``clip`` the gradient norm (0: none); ``unit`` the class a
    hand-written FSDP2 loop shards one by one (None: each top-level child); ``lr`` the
    learning rate of step i, set on every group (None: constant)."""

    build: Callable[[Sizes], nn.Module]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    batch: Callable[[Sizes, int, int], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    clip: float = 0.0
    unit: str | None = None
    lr: Callable[[int], float] | None = None


# -- gpt: bench port's script ---------------------------------------------------------------
def _port(s: Sizes) -> PortBenchConfig:
    return PortBenchConfig(vocab=s.vocab, width=s.width, num_layers=s.num_layers,
                           seq_len=s.seq_len, batch_size=s.batch_size)  # fmt: skip


def _gpt(s: Sizes) -> nn.Module:
    return GPT(_port(s))


def _gpt_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return cast(GPT, model).configure_optimizers()


def _gpt_batch(s: Sizes, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _batch(_port(s), step, rank)


# -- resnet: bench strategy-memory's ResNet-18 with 1000 classes ------------------------------
def _resnet(s: Sizes) -> nn.Module:
    return ResNet18(classes=CLASSES)


def _images(s: Sizes, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(s.batch_size, 3, s.image_size, s.image_size, generator=g)
    return x, torch.randint(0, CLASSES, (s.batch_size,), generator=g)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


# -- lora: a GPT-2-shaped model, frozen but its adapters ------------------------------------
class LoraLinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update (B A x) * alpha / r, B zero at first."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(LORA_RANK, base.in_features) / LORA_RANK)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, LORA_RANK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = (x @ self.lora_a.t()) @ self.lora_b.t()
        return self.base(x) + update * (LORA_ALPHA / LORA_RANK)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.heads = max(1, width // 64)
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn = LoraLinear(nn.Linear(width, 3 * width))
        self.attn_proj = nn.Linear(width, width)
        self.c_fc, self.mlp_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(w, dim=2)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, w))
        return x + self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln_2(x))))


class LoraGPT(nn.Module):
    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(s.vocab, s.width), nn.Embedding(s.seq_len, s.width)
        self.h = nn.ModuleList(Block(s.width) for _ in range(s.num_layers))
        self.ln_f = nn.LayerNorm(s.width)
        self.lm_head = nn.Linear(s.width, s.vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            p.requires_grad_(name.rsplit(".", 1)[-1].startswith("lora_"))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.reshape(-1))


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.0)


# -- mlp ------------------------------------------------------------------------------------
def _mlp(s: Sizes) -> nn.Module:
    w = s.width
    return nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10))


def _vectors(s: Sizes, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(s.batch_size, s.width, generator=g)
    return x, torch.randint(0, 10, (s.batch_size,), generator=g)


def _cross_entropy(output: Any, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


SCRIPTS: dict[str, Script] = {
    "gpt": Script(
        _gpt, _gpt_optimizer, _gpt_batch, clip=1.0, unit="TransformerEncoderLayer", lr=_lr
    ),  # fmt: skip
    "resnet": Script(_resnet, _sgd, _images, _cross_entropy),
    "lora": Script(LoraGPT, _adamw, _gpt_batch, unit="Block"),
    "mlp": Script(_mlp, _adamw, _vectors, _cross_entropy),
}


def parameters_of(model: nn.Module) -> tuple[int, int]:
    """(parameters, trainable parameters) of a plain model."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
