"""Transfer layers (F6): where two adjacent layers run on different devices.

A TransferLayer closes each stage that feeds another rank. Its forward hands the activation to
torch.distributed.pipelining, which sends it point to point to the next stage's rank (NCCL P2P
on GPUs, Gloo over the network on CPUs); in backward the same link carries the gradient of that
activation back. The layer counts what crosses it, so ``engine.stats`` reports transfer bytes
next to exchange bytes, and it makes the boundary visible when the model is printed.
"""

from __future__ import annotations

import torch
from torch import nn


class TransferLayer(nn.Module):
    """Identity at the end of stage ``src`` whose output goes to stage ``dst`` on another rank.

    ``shape`` and ``dtype`` describe one micro-batch's activation (from a trace of the model
    on a sample micro-batch); ``nbytes`` is its size, moved forward once per micro-batch and,
    when it carries a gradient, once more backward."""

    def __init__(self, src: int, dst: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.src, self.dst = src, dst
        self.shape, self.dtype = tuple(shape), dtype
        self.nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.bytes_forward = 0  # activations sent since the last reset
        self.bytes_backward = 0  # activation gradients received back since the last reset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"stage {self.src} -> {self.dst}: a {type(x).__name__} cannot cross a device "
                "boundary; only a tensor can"
            )
        size = x.numel() * x.element_size()
        self.bytes_forward += size
        if x.requires_grad:  # its gradient comes back over the same link
            self.bytes_backward += size
        return x

    def reset_counts(self) -> None:
        self.bytes_forward = self.bytes_backward = 0

    def extra_repr(self) -> str:
        shape = "x".join(map(str, self.shape))
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"stage {self.src} -> {self.dst}, {shape}, {dtype}, {self.nbytes} bytes per micro-batch"
        )
