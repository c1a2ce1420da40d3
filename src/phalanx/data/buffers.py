"""Rotating batch buffers (F3, F10): free -claim-> filling -publish-> ready -take(seq)-> held
-release-> free; claimed in batch order, so the rotation cannot deadlock (docs/data.md)."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from phalanx.errors import DataError


class PipelineClosed(DataError):
    """The pipeline was closed while someone waited on its buffers."""


@dataclass
class Slot:
    """One batch buffer. ``batch`` and ``error`` are set by producers, read by the consumer."""

    index: int  # which buffer (device staging memory is kept per buffer)
    seq: int = -1  # which batch of the stream it holds
    epoch: int = 0
    step: int = 0
    batch: Any = None
    error: BaseException | None = None

    def clear(self) -> None:
        self.seq, self.batch, self.error = -1, None, None


class BatchBuffers:
    """The ring of slots and the condition every state change is signalled on."""

    def __init__(self, num_buffers: int, first_seq: int = 0) -> None:
        assert num_buffers >= 1
        self.num_buffers = num_buffers
        self._cond = threading.Condition()
        self._free: deque[Slot] = deque(Slot(i) for i in range(num_buffers))
        self._ready: dict[int, Slot] = {}
        self._next_seq = first_seq
        self._closed = False

    def claim(self) -> Slot | None:
        """A free slot bound to the next sequence number; waits for one; None once closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._free or self._closed)
            if self._closed:
                return None
            slot = self._free.popleft()
            slot.seq = self._next_seq
            self._next_seq += 1
            return slot

    def publish(self, slot: Slot) -> None:
        """The slot is filled (or holds its producer's error): it becomes ready."""
        with self._cond:
            if not self._closed:
                self._ready[slot.seq] = slot
                self._cond.notify_all()

    def take(self, seq: int, timeout_s: float) -> Slot:
        """Batch ``seq``, waiting for it; DataError after ``timeout_s`` or once closed."""
        with self._cond:
            ready = self._cond.wait_for(lambda: seq in self._ready or self._closed, timeout_s)
            if self._closed:
                raise PipelineClosed("the pipeline is closed")
            if not ready:
                raise DataError(f"input pipeline: batch {seq} not ready after {timeout_s:g} s")
            return self._ready.pop(seq)

    def release(self, slot: Slot) -> None:
        """The consumer is done with the slot: it is free again."""
        with self._cond:
            slot.clear()
            self._free.append(slot)
            self._cond.notify_all()

    @property
    def num_ready(self) -> int:
        with self._cond:
            return len(self._ready)

    def close(self) -> None:
        """Wake every waiter; claims return None and takes raise from now on."""
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._cond.notify_all()
