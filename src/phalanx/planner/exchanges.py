"""The exchanges the planner simulates: phalanx's strategies (each with the message schedule its
own class states, ``Strategy.Messages``) and models of other systems (``MODELS``), by name in
``SCHEDULES``. Nothing outside the strategies and these registries branches on a strategy's or
codec's name."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from phalanx.errors import ConfigError
from phalanx.exchange.base import STRATEGIES, strategy_factory
from phalanx.exchange.messages import (
    FORWARD,
    FORWARD_PASS,
    GRAD,
    KIND_NAMES,
    PARAM,
    STEP,
    Builder,
    Message,
    Phase,
    RoundTable,
    UnitPhases,
    WireCodec,
    ring_rounds,
)
from phalanx.exchange.messages import MessageSchedule as Schedule
from phalanx.exchange.tree import tree_up
from phalanx.fields import ConfigValueError
from phalanx.registry import Registry

__all__ = [
    "FORWARD",
    "FORWARD_PASS",
    "GRAD",
    "KIND_NAMES",
    "PARAM",
    "STEP",
    "Message",
    "Phase",
    "RoundTable",
    "Schedule",
    "UnitPhases",
]


# -- models of other systems ---------------------------------------------------------------------
MODELS: Registry[Schedule] = Registry("exchange schedule")


@MODELS.register("ring")
class RingSchedule(Schedule):
    """phalanx's point-to-point ring (exchange/ring.py) for every bucket: 2(p-1) steps."""

    models_strategy = False  # the transport of compressed ``allreduce``, not a strategy

    def bucket_phases(self, world: int, codec: WireCodec, nbytes: float) -> list[Phase]:
        return [Phase("ring", ring_rounds(world))] if world > 1 else []

    def on_thread(self, codec: WireCodec, last: bool) -> bool:
        return not last  # as compressed ``allreduce`` runs it


@functools.lru_cache(maxsize=64)
def tree_up_rounds(world: int) -> RoundTable:
    """Only the reduction of ``tree``'s rounds: the sum ends at rank 0."""
    b = Builder()
    tree_up(list(range(world)), 1.0, b)
    return b.table("tree_up", world)


@functools.lru_cache(maxsize=64)
def star_rounds(world: int, root: int = 0) -> RoundTable:
    """The root sends the whole bucket (parameters) to every other rank, one after another."""
    b = Builder()
    for other in (r for r in range(world) if r != root):
        b.rounds(np.array([root]), np.array([other]), 1.0, PARAM)
    return b.table("star", world, root)


@MODELS.register("tree_ps")
class TreeServerSchedule(Schedule):
    """The parallel-CNN paper's parameter server (seed 001, Fig. 1 and section 2): each
    layer's gradients are summed up a binary tree to the server (rank 0) while backward runs,
    the server updates that layer, and before the next iteration every replica fetches the
    updated parameters from the server. Not a phalanx strategy: modelled to compare with that
    paper (phalanx's ``tree`` sends the sum back down the tree instead, overlapped)."""

    models_strategy = False

    def bucket_phases(self, world: int, codec: WireCodec, nbytes: float) -> list[Phase]:
        if world < 2:
            return []
        return [Phase("reduce", tree_up_rounds(world)), Phase("update", update_fraction=1.0)]

    def optimizer_fraction(self, world: int) -> float:
        return 0.0 if world > 1 else 1.0

    def return_phases(self, world: int) -> list[Phase]:
        # STEP: the next iteration starts once every replica holds every parameter.
        return [Phase("fetch", star_rounds(world), gates=STEP)] if world > 1 else []

    def on_thread(self, codec: WireCodec, last: bool) -> bool:
        return False  # another system's server (its own threads are not phalanx's)


# -- every schedule by name -----------------------------------------------------------------------
class _Schedules:
    """The names ``make_schedule`` knows: phalanx's strategies and the ``MODELS``."""

    def names(self) -> list[str]:
        return sorted([*STRATEGIES.names(), *MODELS.names()])

    def __contains__(self, name: object) -> bool:
        return name in STRATEGIES or name in MODELS

    def __iter__(self) -> Any:
        return iter(self.names())


SCHEDULES = _Schedules()


def make_schedule(name: str, options: dict[str, Any] | None = None) -> Schedule:
    """The schedule ``name`` with the strategy's ``options`` (the strategy's own Config: the
    same keys, the same one-line errors)."""
    if name in MODELS:
        return MODELS.get(name)(**(options or {}))
    if name not in STRATEGIES:
        raise ConfigError(f"unknown exchange schedule {name!r}; known: {', '.join(SCHEDULES)}")
    try:
        return strategy_factory(name, options).messages()
    except ConfigValueError as e:
        raise ConfigError(f"exchange.{e.key}: {e.reason}") from None


def agreement_phases(world: int) -> list[Phase]:
    """The non-finite guard's agreement (``Schedule.agrees_before_backward``): a 1-element
    allreduce, as the backend's ring (4 bytes: its rounds' latency)."""
    return [Phase("agree", ring_rounds(world, backend=True))] if world > 1 else []
