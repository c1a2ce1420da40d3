"""Teardown: closes an Engine's parts once, whether the Engine is closed, collected or not."""

from __future__ import annotations

import threading
from typing import Any

from phalanx.runtime.context import hold_until_shutdown, unregister_shutdown


class Teardown:
    """Closes an Engine's parts once: pending exchanges finish, hooks go, threads stop.

    Owns the parts, not the Engine, so it still runs at ``phalanx.shutdown()`` (and interpreter
    exit) when the user dropped the Engine first: every rank then completes the last step's
    exchange before it leaves, whatever the script did after its last ``step()``."""

    def __init__(self, slot: Any, buckets: Any, pipeline: Any, memory: Any) -> None:
        """``slot`` (its current strategy), ``buckets`` (GradientBuckets), ``pipeline`` and
        ``memory`` (None where the Engine has none): what ``__call__`` closes, in this order."""
        self.parts: tuple | None = (slot, buckets, pipeline, memory)
        self.thread = threading.get_ident()  # the thread that built the Engine
        self.held: list[Any] = []  # the Engine's own last backend works (hold_until_shutdown)

    def hold(self, works: list[Any]) -> None:
        """Keep the Engine's last backend works (until replaced, or released at shutdown)."""
        self.held = works

    def __call__(self) -> None:
        if self.parts is None:
            return
        slot, buckets, pipeline, memory = self.parts
        self.parts = None
        hold_until_shutdown(self.held)
        self.held = []
        try:
            slot.current.close()
        finally:
            buckets.remove_hooks()
            if pipeline is not None:
                pipeline.close()
            if memory is not None:
                memory.close()

    @property
    def closed(self) -> bool:
        return self.parts is None

    def on_collected(self) -> None:
        """The Engine was garbage-collected: close now on the building thread (a collection
        elsewhere, e.g. on a communication thread that could not join itself, leaves it to
        shutdown, which still holds this teardown)."""
        if threading.get_ident() == self.thread:
            unregister_shutdown(self)
            self()
