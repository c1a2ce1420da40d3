"""Disjoint per-rank batches of an in-memory training set, deterministic per epoch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.errors import DataError


@dataclass
class Position:
    """Where the loader is: the epoch and the next step within it."""

    epoch: int = 0
    step: int = 0


def position_state(position: Position, global_batch: int) -> dict[str, int]:
    """The position as samples consumed in the epoch, so any world size can resume it."""
    samples = position.step * global_batch
    return {"epoch": position.epoch, "step": position.step, "samples": samples}


def position_from_state(state: dict[str, int], global_batch: int) -> Position:
    """Inverse of ``position_state`` for this ``global_batch``; a partial global batch is
    skipped, not repeated."""
    samples = int(state.get("samples", int(state["step"]) * global_batch))
    return Position(int(state["epoch"]), -(-samples // global_batch))


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The sample order of ``epoch``: ``torch.randperm`` seeded ``seed + epoch`` (or ``arange``)."""
    if not shuffle:
        return torch.arange(size)
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch))


class ShardedBatches:
    """Rank r's contiguous slice of each step's global batch from the epoch's permutation
    (``GlobalOrder``'s order, short batches dropped): x and y on the CPU."""

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        self.x, self.y = x, y
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.global_batch = batch_size * world_size
        self.steps_per_epoch = len(x) // self.global_batch
        if self.steps_per_epoch == 0:
            raise DataError(
                f"data.batch_size: global batch {self.global_batch} ({batch_size} x "
                f"{world_size} ranks) exceeds the {len(x)} training samples"
            )
        self.position = Position()
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        return epoch_order(len(self.x), self.seed, epoch, self.shuffle)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch of this rank; advances the position (and the epoch at its end)."""
        if self.position.step >= self.steps_per_epoch:
            self.position = Position(self.position.epoch + 1, 0)
            self._order = self._permutation(self.position.epoch)
        start = self.position.step * self.global_batch + self.rank * self.batch_size
        index = self._order[start : start + self.batch_size]
        self.position.step += 1
        return self.x[index], self.y[index]

    def state_dict(self) -> dict[str, int]:
        return position_state(self.position, self.global_batch)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = position_from_state(state, self.global_batch)
        self._order = self._permutation(self.position.epoch)
