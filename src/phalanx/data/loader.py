"""Disjoint per-rank batches of an in-memory training set, deterministic per epoch."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
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
    """Inverse of ``position_state``; a partial global batch is skipped, not repeated."""
    samples = int(state.get("samples", int(state["step"]) * global_batch))
    return Position(int(state["epoch"]), -(-samples // global_batch))


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The sample order of ``epoch``: ``torch.randperm`` seeded ``seed + epoch`` (or ``arange``)."""
    if not shuffle:
        return torch.arange(size)
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch))


class GlobalOrder:
    """Rank ``r``'s contiguous slice of each global batch of an epoch's order (docs/data.md)."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool,
        drop_last: bool,
    ) -> None:
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.global_batch = batch_size * world_size
        full, partial = divmod(num_samples, self.global_batch)
        self.steps_per_epoch = full if drop_last else full + (partial > 0)
        self._cache: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def permutation(self, epoch: int) -> np.ndarray:
        with self._lock:
            order = self._cache.get(epoch)
            if order is None:
                order = epoch_order(self.num_samples, self.seed, epoch, self.shuffle).numpy()
                self._cache = {e: o for e, o in self._cache.items() if e >= epoch - 1}
                self._cache[epoch] = order
            return order

    def indices(self, epoch: int, step: int) -> np.ndarray:
        """This rank's sample indices, int64 (batch_size,) (shorter: a last step, no drop_last)."""
        start = step * self.global_batch
        if start + self.global_batch <= self.num_samples:
            lo = start + self.rank * self.batch_size
            hi = lo + self.batch_size
        else:
            share, extra = divmod(self.num_samples - start, self.world_size)
            lo = start + self.rank * share + min(self.rank, extra)
            hi = lo + share + (self.rank < extra)
        return self.permutation(epoch)[lo:hi]


class ShardedBatches:
    """Rank r's slice of each global batch of the epoch's permutation (x, y on the CPU)."""

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
        self.order = GlobalOrder(len(x), batch_size, rank, world_size, seed, shuffle, True)
        self.global_batch, self.steps_per_epoch = (
            self.order.global_batch,
            self.order.steps_per_epoch,
        )
        if self.steps_per_epoch == 0:
            raise DataError(
                f"data.batch_size: global batch {self.global_batch} ({batch_size} x "
                f"{world_size} ranks) exceeds the {len(x)} training samples"
            )
        self.position = Position()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch of this rank; advances the position (and the epoch at its end)."""
        if self.position.step >= self.steps_per_epoch:
            self.position = Position(self.position.epoch + 1, 0)
        index = torch.from_numpy(self.order.indices(self.position.epoch, self.position.step))
        self.position.step += 1
        return self.x[index], self.y[index]

    def state_dict(self) -> dict[str, int]:
        return position_state(self.position, self.global_batch)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = position_from_state(state, self.global_batch)
