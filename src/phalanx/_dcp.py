"""torch.distributed.checkpoint and what phalanx adds: planners for ``Slices``, shared values
from the lowest rank, non-tensor values whole, ``weights_only`` refusals at save time, ``None``
placeholders; a writer with the fault point ``checkpoint``. Imported on first use (DCP is slow)."""

from __future__ import annotations

import dataclasses
import io
import re
from collections.abc import Mapping, MutableMapping
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
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from phalanx.errors import CheckpointError
from phalanx.faults import fault_at
from phalanx.slices import Slices

__all__ = [
    "CheckpointException",
    "LoadPlanner",
    "SavePlanner",
    "TensorStorageMetadata",
    "Writer",
    "dcp",
    "holds_tensors",
    "set_element",
    "structure",
    "template",
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


# -- values DCP's flattening would garble, kept whole -------------------------------------------
class Whole:
    """A value DCP writes and reads as one pickled value instead of flattening it."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def holds_tensors(value: Any) -> bool:
    """Whether ``value`` is or holds (in dicts, lists, tuples) a tensor or ``Slices``."""
    if isinstance(value, (torch.Tensor, Slices)):
        return True
    if isinstance(value, Mapping):
        return any(holds_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_tensors(v) for v in value)
    return False


def _garbled(value: Any) -> bool:
    """Whether DCP's flattening would change ``value``: it turns keys into strings (MultiStepLR's
    Counter of milestones would load changed, then save each key twice)."""
    if isinstance(value, Mapping):
        return any(not isinstance(k, str) or _garbled(v) for k, v in value.items())
    return isinstance(value, list) and any(_garbled(v) for v in value)


def _kept_whole(value: Any) -> Any:
    """``value`` for DCP's flattening: each tensor-free part it would garble as a ``Whole``
    (a list as a whole: DCP pickles a list of plain values as one)."""
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value) and not holds_tensors(value):
            return Whole(value)
        return {k: _kept_whole(v) for k, v in value.items()}
    if isinstance(value, list) and holds_tensors(value):
        return [_kept_whole(v) for v in value]
    return Whole(value) if _garbled(value) else value


_PLAIN = (type(None), bool, int, float, str)


def _plain(value: Any) -> bool:
    """Built of values every loader reads (checked without pickling them)."""
    if type(value) in _PLAIN:
        return True
    if type(value) in (list, tuple):
        return all(_plain(v) for v in value)
    return type(value) is dict and all(type(k) in _PLAIN and _plain(v) for k, v in value.items())


def check_loadable(fqn: str, value: Any) -> None:
    """Refuse now, naming it, a value that loading (``torch.load(weights_only=True)``) would
    refuse at resume, after the run has gone on for hours."""
    if _plain(value):
        return
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever it is, the checkpoint would not load
        named = re.search(r"GLOBAL (\S+)", str(e))
        what = named.group(1) if named else type(value).__name__
        raise CheckpointError(
            f"checkpoint: {fqn!r} holds a {what}, which loading refuses (torch.load with "
            "weights_only=True); save numbers, strings, lists, dicts or tensors there, or give "
            "its object state_dict() and load_state_dict()"
        ) from None


def lowest_rank_writes(plans: list[Any]) -> list[Any]:
    """Each item several ranks would write left to the lowest of them: DCP's own choice may
    take any rank's copy, and copies differ (BatchNorm's statistics follow each rank's batch)."""
    seen: set[MetadataIndex] = set()
    out = []
    for plan in plans:
        out.append(dataclasses.replace(plan, items=[i for i in plan.items if i.index not in seen]))
        seen.update(item.index for item in plan.items)
    return out


# -- the checkpoint's structure, and room to load it into -------------------------------------
def structure(metadata: Any) -> dict[str, Any]:
    """The nested structure DCP's ``metadata`` describes, its leaves DCP's storage metadata
    (TensorStorageMetadata: shape, dtype and chunks; BytesStorageMetadata)."""
    mappings = metadata.planner_data or {}
    tree: dict[str, Any] = {}
    for key, value in metadata.state_dict_metadata.items():
        set_element(tree, mappings.get(key, (key,)), value)
    return tree


def template(stored: Any) -> Any:
    """Room to load the stored structure ``stored`` into: empty tensors for tensors, None for
    other values (loading replaces them)."""
    if isinstance(stored, Mapping):
        return {k: template(v) for k, v in stored.items()}
    if isinstance(stored, list):
        return [template(v) for v in stored]
    if isinstance(stored, TensorStorageMetadata):
        return torch.empty(stored.size, dtype=stored.properties.dtype)
    return None


def _child(stored: Any, key: Any) -> Any:
    """What the checkpoint holds under ``key`` of ``stored`` (DCP's paths hold str(key))."""
    if isinstance(stored, Mapping):
        return stored.get(str(key))
    if isinstance(stored, list) and isinstance(key, int) and key < len(stored):
        return stored[key]
    return None


def _fill_placeholders(room: Any, stored: Any) -> None:
    """Where ``room`` holds None and the checkpoint a structure or a tensor, room for it (in
    place: DCP hands the caller ``room``)."""
    entries = list(room.items()) if isinstance(room, Mapping) else list(enumerate(room))
    for key, value in entries:
        inner = _child(stored, key)
        if value is None and inner is not None and not isinstance(inner, BytesStorageMetadata):
            if isinstance(room, (MutableMapping, list)):
                room[key] = template(inner)
        elif isinstance(value, (Mapping, list)) and inner is not None:
            _fill_placeholders(value, inner)


def _as_stored(value: Any, stored: Any) -> Any:
    """``value`` for DCP's flattening, whole where the checkpoint holds one value."""
    if isinstance(value, (Mapping, list)) and isinstance(stored, BytesStorageMetadata):
        return Whole(value)
    if isinstance(value, Mapping):
        return {k: _as_stored(v, _child(stored, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_stored(v, _child(stored, i)) for i, v in enumerate(value)]
    return value


def _put(root: Any, path: tuple[Any, ...], value: Any) -> None:
    """``set_element`` that finds a mapping's other keys by their str form (a Counter's 3 is
    '3' on DCP's paths; a checkpoint written before values were kept whole has them so)."""
    node = root
    for part in path[:-1]:
        node = node[_key(node, part)]
    node[_key(node, path[-1])] = value


def _key(node: Any, part: Any) -> Any:
    if isinstance(node, Mapping) and part not in node:
        return next((k for k in node if str(k) == part), part)
    return part


# -- planners -----------------------------------------------------------------------------------
class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner with the additions the module docstring lists."""

    def set_up_planner(
        self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        kept = {k: _kept_whole(v) for k, v in state_dict.items()}
        super().set_up_planner(kept, storage_meta, is_coordinator)

    def create_local_plan(self) -> Any:
        slices = {k: v for k, v in self.state_dict.items() if isinstance(v, Slices)}
        full = self.state_dict
        self.state_dict = {k: v for k, v in full.items() if k not in slices}
        try:
            plan = super().create_local_plan()
        finally:
            self.state_dict = full
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                check_loadable(item.index.fqn, self.lookup_object(item.index))
        items = [item for fqn, value in slices.items() for item in write_items(value, fqn)]
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def create_global_plan(self, all_plans: list[Any]) -> Any:
        return super().create_global_plan(lowest_rank_writes(all_plans))

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, Slices):
            return value.piece(index)
        value = super().lookup_object(index)
        return value.value if isinstance(value, Whole) else value


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that also reads into ``Slices`` (only this rank's boxes),
    unpickles with ``weights_only=True`` and fills ``None`` placeholders."""

    def set_up_planner(
        self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        self.original_state_dict = state_dict
        view = state_dict
        if metadata is not None:
            stored = structure(metadata)
            _fill_placeholders(state_dict, stored)
            view = _as_stored(state_dict, stored)
        self.state_dict, self.mappings = flatten_state_dict(view)
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
        _put(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)


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
