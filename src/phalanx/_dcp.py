"""torch.distributed.checkpoint and what phalanx adds to it: planners that save and load
``phalanx.slices.Slices`` (pieces of a tensor that several ranks hold parts of) and unpickle
non-tensor values with ``weights_only=True``, and a file writer with the fault point
``checkpoint``. Imported on first use by phalanx.checkpoint (importing DCP is slow)."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from phalanx.faults import fault_at
from phalanx.slices import Slices

__all__ = [
    "CheckpointException",
    "LoadPlanner",
    "SavePlanner",
    "TensorStorageMetadata",
    "Writer",
    "dcp",
    "set_element",
]


def chunks(value: Slices) -> list[ChunkStorageMetadata]:
    return [ChunkStorageMetadata(torch.Size(o), t.size()) for o, t in value.boxes]


def write_items(value: Slices, fqn: str) -> list[WriteItem]:
    properties = TensorProperties(dtype=value.dtype)
    return [
        WriteItem(
            index=MetadataIndex(fqn, chunk.offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=value.shape),
        )
        for chunk in chunks(value)
    ]


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner that also writes ``Slices`` (each piece a chunk)."""

    def create_local_plan(self) -> Any:
        slices = {k: v for k, v in self.state_dict.items() if isinstance(v, Slices)}
        full = self.state_dict
        self.state_dict = {k: v for k, v in full.items() if k not in slices}
        try:
            plan = super().create_local_plan()
        finally:
            self.state_dict = full
        items = [item for fqn, value in slices.items() for item in write_items(value, fqn)]
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, Slices):
            return value.piece(index)
        return super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that also reads into ``Slices`` (only the boxes this rank
    asks for: DCP reads the overlapping stored chunks), and unpickles non-tensor values with
    ``weights_only=True``."""

    def set_up_planner(
        self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> Any:
        assert self.metadata is not None
        slices = {k: v for k, v in self.state_dict.items() if isinstance(v, Slices)}
        rest = {k: v for k, v in self.state_dict.items() if k not in slices}
        plan = create_default_local_load_plan(rest, self.metadata)  # strict: every key
        items = []
        for fqn, value in slices.items():
            stored = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(stored, TensorStorageMetadata) or stored.size != value.shape:
                raise ValueError(f"{fqn}: the checkpoint has no tensor of shape {value.shape}")
            items += create_read_items_for_chunk_list(fqn, stored, chunks(value))
        return dataclasses.replace(plan, items=[*plan.items, *items])

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, Slices):
            return value.piece(index)
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, map_location="cpu", weights_only=True)
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)


class Writer(dcp.FileSystemWriter):
    """DCP's file writer; the fault point ``checkpoint`` fires once this rank's shard files
    are written, before the checkpoint is complete."""

    def __init__(self, path: Path, step: int) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.step = step
        self.written: list[str] = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        self.written = sorted({r.storage_data.relative_path for r in future.wait()})
        fault_at("checkpoint", self.step)
        return future
