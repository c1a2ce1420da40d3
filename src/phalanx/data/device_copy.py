"""The input pipeline's device stage (F10): ``stage`` in a worker, ``hand_over`` in the trainer;
on CUDA pinned buffers, a side stream and an event (docs/data.md), on the CPU synchronous."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

Batch = tuple[torch.Tensor, ...]


@dataclass
class Staged:
    """A batch on its way to the device; ``event`` (CUDA) marks the end of its copy."""

    batch: Batch
    event: Any = None


class HostCopy:
    """Synchronous copy (a no-op for CPU tensors bound for the CPU)."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device

    def stage(self, batch: Batch, buffer_index: int) -> Staged:
        if self.device is None:
            return Staged(batch)
        return Staged(tuple(_to(t, self.device) for t in batch))

    def hand_over(self, staged: Staged) -> Batch:
        return staged.batch


class CudaCopy:
    """Pinned staging per buffer + a side copy stream + an event per batch."""

    def __init__(self, device: torch.device) -> None:
        assert device.type == "cuda"
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._pinned: dict[int, list[torch.Tensor]] = {}
        self._events: dict[int, torch.cuda.Event] = {}
        self._lock = threading.Lock()

    def stage(self, batch: Batch, buffer_index: int) -> Staged:
        with self._lock:
            previous = self._events.get(buffer_index)
        if previous is not None:
            previous.synchronize()  # the staging memory's last copy has finished
        pinned = self._staging(buffer_index, batch)
        out = []
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for tensor, host in zip(batch, pinned):
                if not isinstance(tensor, torch.Tensor) or tensor.device.type == "cuda":
                    out.append(tensor)
                    continue
                host.copy_(tensor)
                out.append(host.to(self.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self.stream)
        with self._lock:
            self._events[buffer_index] = event
        return Staged(tuple(out), event)

    def hand_over(self, staged: Staged) -> Batch:
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(staged.event)
        for tensor in staged.batch:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda":
                tensor.record_stream(stream)  # the allocator must not reuse it before compute ends
        return staged.batch

    def _staging(self, buffer_index: int, batch: Batch) -> list[torch.Tensor]:
        """This buffer's pinned tensors, reallocated when the batch's shapes or dtypes change."""
        with self._lock:
            pinned = self._pinned.get(buffer_index, [])
        fits = len(pinned) == len(batch) and all(
            isinstance(t, torch.Tensor) and p.shape == t.shape and p.dtype == t.dtype
            for p, t in zip(pinned, batch)
        )
        if not fits:
            pinned = [
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                if isinstance(t, torch.Tensor)
                else torch.empty(0)
                for t in batch
            ]
            with self._lock:
                self._pinned[buffer_index] = pinned
        return pinned


def _to(tensor: Any, device: torch.device) -> Any:
    return tensor.to(device) if isinstance(tensor, torch.Tensor) else tensor


def make_device_stage(device: torch.device | str | None) -> HostCopy | CudaCopy:
    """CudaCopy for a CUDA device, HostCopy otherwise (CPU, or None = keep batches on the host)."""
    device = None if device is None else torch.device(device)
    return CudaCopy(device) if device is not None and device.type == "cuda" else HostCopy(device)
