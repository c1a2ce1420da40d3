"""Training data: built-in sources, record stores and the input pipeline."""

from phalanx.data.loader import ShardedBatches
from phalanx.data.pipeline import POOLS, Pipeline
from phalanx.data.readers import pad_collate, stack_collate
from phalanx.data.records import RecordStore, write_store
from phalanx.data.sources import SOURCES, DataConfig, Dataset, load_source

__all__ = [
    "POOLS",
    "SOURCES",
    "DataConfig",
    "Dataset",
    "Pipeline",
    "RecordStore",
    "ShardedBatches",
    "load_source",
    "pad_collate",
    "stack_collate",
    "write_store",
]
