"""Gradient exchange: buckets filled during backward, strategies registered by name."""

from phalanx.exchange import (  # noqa: F401  (register the built-in strategies)
    allreduce,
    fsdp,
    param_server,
    partitioned,
    tree,
)
from phalanx.exchange.base import (
    STRATEGIES,
    ExchangeConfig,
    Strategy,
    StrategyFactory,
    StrategyParts,
    strategy_factory,
)
from phalanx.exchange.buckets import Bucket, GradientBuckets

__all__ = [
    "STRATEGIES",
    "Bucket",
    "ExchangeConfig",
    "GradientBuckets",
    "Strategy",
    "StrategyFactory",
    "StrategyParts",
    "strategy_factory",
]
