"""Transfer layers (F6): the end of a stage that feeds another rank (torch.distributed.pipelining
sends its output point to point); they count the bytes crossing and show the cut when printed."""

from __future__ import annotations

import torch
from torch import nn


class TransferLayer(nn.Module):
    """Identity at the end of stage ``src`` whose output goes to stage ``dst`` on another rank;
    ``shape``, ``dtype``: one micro-batch's activation (``nbytes`` each way per micro-batch)."""

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
