"""Model parallelism from the config: pipeline stages, transfer layers, worker groups (F6, F7)."""

from phalanx.parallel.layout import ParallelConfig
from phalanx.parallel.transfer import TransferLayer

__all__ = ["ParallelConfig", "TransferLayer"]
