"""Pieces of a tensor that several ranks hold parts of (sharded optimizer state), as checkpoints
store them; below both ``phalanx.checkpoint`` and ``phalanx._dcp``."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch


def _boxes(shape: Sequence[int], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The flat range [lo, hi) of a row-major tensor of ``shape`` as boxes (offsets, sizes), each
    itself a contiguous flat range, in order: at most 2 * ndim - 1 of them."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    rest = [0] * (len(shape) - 1)

    def row(r: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((r, *o), (1, *s)) for o, s in _boxes(shape[1:], a, b)]

    if first == last:
        return row(first, lo - first * inner, hi - first * inner)
    out = row(first, lo % inner, inner) if lo % inner else []
    full_from = first + (1 if lo % inner else 0)
    full_to = last + 1 if hi % inner == 0 else last
    if full_to > full_from:
        out.append(((full_from, *rest), (full_to - full_from, *shape[1:])))
    if hi % inner:
        out += row(last, 0, hi - last * inner)
    return out


class Slices:
    """This rank's pieces of a tensor as boxes (offsets, sizes) of the full one, so any box can be
    read back on another world size; a flat range is at most 2 * ndim - 1 boxes."""

    def __init__(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        boxes: list[tuple[tuple[int, ...], torch.Tensor]],
    ) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.boxes = boxes  # (offsets, tensor of the box's sizes)

    @classmethod
    def from_flat(cls, shape: Sequence[int], pieces: list[tuple[int, torch.Tensor]]) -> Slices:
        """From (flat start, 1-D tensor) pieces; the boxes are views of them (no copy)."""
        boxes = []
        for start, flat in pieces:
            for offsets, sizes in _boxes(shape, start, start + flat.numel()):
                at = _flat_offset(shape, offsets) - start
                boxes.append((offsets, flat[at : at + math.prod(sizes)].view(sizes)))
        return cls(shape, pieces[0][1].dtype, boxes)

    @classmethod
    def empty(
        cls, shape: Sequence[int], dtype: torch.dtype, ranges: list[tuple[int, int]]
    ) -> Slices:
        """Room for the flat ``ranges`` of the tensor, for DCP to load into."""
        return cls.from_flat(shape, [(lo, torch.empty(hi - lo, dtype=dtype)) for lo, hi in ranges])

    def size(self) -> torch.Size:
        return self.shape

    def flat_pieces(self) -> list[tuple[int, torch.Tensor]]:
        """The pieces as (flat start, 1-D tensor)."""
        return [(_flat_offset(self.shape, o), t.reshape(-1)) for o, t in self.boxes]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.boxes)

    def piece(self, index: Any) -> torch.Tensor:
        """The piece DCP's MetadataIndex names."""
        for offsets, tensor in self.boxes:
            if torch.Size(offsets) == index.offset:
                return tensor
        raise ValueError(f"{index.fqn}: no piece at {index.offset}")


class LazySlices(Slices):
    """Slices whose pieces ``load(flat start, numel)`` reads as the writer asks (a tier's state,
    one piece at a time; meta tensors until then); ``materialized()`` reads all."""

    def __init__(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        ranges: list[tuple[int, int]],
        load: Callable[[int, int], torch.Tensor],
    ) -> None:
        boxes = [
            (offsets, torch.empty(sizes, dtype=dtype, device="meta"))
            for lo, hi in ranges
            for offsets, sizes in _boxes(shape, lo, hi)
        ]
        super().__init__(shape, dtype, boxes)
        self._load = load

    def piece(self, index: Any) -> torch.Tensor:
        placeholder = super().piece(index)
        start = _flat_offset(self.shape, index.offset)
        return self._load(start, placeholder.numel()).view(placeholder.shape)

    def materialized(self) -> Slices:
        boxes = [
            (o, self._load(_flat_offset(self.shape, o), t.numel()).view(t.shape))
            for o, t in self.boxes
        ]
        return Slices(self.shape, self.dtype, boxes)


def _flat_offset(shape: Sequence[int], offsets: Sequence[int]) -> int:
    flat, stride = 0, 1
    for size, offset in zip(reversed(shape), reversed(offsets)):
        flat += offset * stride
        stride *= size
    return flat
