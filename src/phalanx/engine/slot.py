"""StrategySlot: the one holder of an Engine's current exchange strategy."""

from __future__ import annotations

import dataclasses

from phalanx.exchange.base import Strategy, StrategyFactory, StrategyParts
from phalanx.exchange.buckets import Bucket, GradientBuckets
from phalanx.runtime.context import Context


class StrategySlot:
    """Everything that needs the current strategy (the buckets' launches, the Engine's step, the
    teardown, the trace, the pipeline driver, the checkpoint state) holds this slot and reads
    ``current``: a bucket rebuild replaces the strategy here, once, and closes the old one, so
    no holder can keep a closed strategy.

    ``factory`` builds a strategy over ``buckets``' current layout with ``parts`` (the codec,
    the optimizer's groups, the module); the buckets launch into the slot."""

    def __init__(
        self,
        factory: StrategyFactory,
        ctx: Context,
        buckets: GradientBuckets,
        parts: StrategyParts,
    ) -> None:
        self._factory, self._ctx, self._buckets, self._parts = factory, ctx, buckets, parts
        self.current: Strategy = self._build(previous=None)
        buckets.launch = self.launch  # the buckets' one callback, set once

    def launch(self, bucket: Bucket) -> None:
        """A full bucket (its gradients summed locally) goes to the current strategy."""
        self.current.launch(bucket)

    def rebuild(self) -> Strategy:
        """A strategy for the buckets' new layout takes over the old one's communication
        thread and listeners; the old one is closed (its hooks go)."""
        old = self.current
        self.current = self._build(previous=old)
        old.close()
        return self.current

    def _build(self, previous: Strategy | None) -> Strategy:
        parts = dataclasses.replace(self._parts, previous=previous)
        return self._factory(self._ctx, self._buckets.buckets, parts)
