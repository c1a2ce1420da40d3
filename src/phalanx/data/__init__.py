"""Training data: built-in sources and the sharded per-rank batch loader."""

from phalanx.data.loader import ShardedBatches
from phalanx.data.sources import SOURCES, DataConfig, Dataset, load_source

__all__ = ["SOURCES", "DataConfig", "Dataset", "ShardedBatches", "load_source"]
