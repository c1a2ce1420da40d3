"""The input pipeline (F2, F3, F10): an I/O thread, a preprocessing pool, rotating batch buffers
and a device stage, feeding one rank its disjoint slice of a deterministic global order."""

from __future__ import annotations

import os
import pickle
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from phalanx.data.buffers import BatchBuffers, PipelineClosed, Slot
from phalanx.data.device_copy import make_device_stage
from phalanx.data.loader import GlobalOrder, Position, position_from_state, position_state
from phalanx.data.readers import Batch, Collate, as_batch, as_reader
from phalanx.errors import DataError
from phalanx.fields import require
from phalanx.registry import Registry

Preprocess = Callable[[Batch, np.random.Generator], Any]
JOIN_TIMEOUT_S = 30.0  # how long close() waits for a thread still inside user code


# -- preprocessing pools ---------------------------------------------------------------------------
class ThreadPool:
    """``preprocess`` runs in the pipeline's worker threads (numpy and torch release the GIL)."""

    def __init__(self, preprocess: Preprocess, num_workers: int) -> None:
        self.preprocess = preprocess

    def run(self, batch: Batch, rng: np.random.Generator) -> Batch:
        return as_batch(self.preprocess(batch, rng))

    def close(self) -> None:
        pass


class ProcessPool:
    """``preprocess`` (picklable) in ``num_workers`` spawned processes, for work holding the GIL."""

    def __init__(self, preprocess: Preprocess, num_workers: int) -> None:
        try:
            pickle.dumps(preprocess)
        except Exception as e:
            raise DataError(
                f"preprocess: pool='process' needs a picklable function (defined at module "
                f"level); {e}"
            ) from None
        import multiprocessing

        self.preprocess = preprocess
        self._executor = ProcessPoolExecutor(
            num_workers, mp_context=multiprocessing.get_context("spawn"), initializer=_child_init
        )

    def run(self, batch: Batch, rng: np.random.Generator) -> Batch:
        arrays = tuple(t.numpy() for t in batch)
        return self._executor.submit(_child_preprocess, self.preprocess, arrays, rng).result()

    def close(self) -> None:
        """Cancel queued work, wait for the children; terminate any stuck in user code."""
        procs = list((getattr(self._executor, "_processes", None) or {}).values())
        stop, name = {"wait": True, "cancel_futures": True}, "phalanx-pool-close"
        closer = threading.Thread(target=self._executor.shutdown, kwargs=stop, name=name)
        closer.start()
        closer.join(JOIN_TIMEOUT_S)
        if closer.is_alive():
            for p in procs:
                p.terminate()
            closer.join(JOIN_TIMEOUT_S)
        for p in procs:
            p.join(JOIN_TIMEOUT_S)


def _child_init() -> None:
    torch.set_num_threads(1)  # one core per worker process, like DataLoader workers


def _child_preprocess(
    preprocess: Preprocess, arrays: tuple[np.ndarray, ...], rng: np.random.Generator
) -> Batch:
    batch = tuple(torch.from_numpy(a) for a in arrays)
    return tuple(t.contiguous() for t in as_batch(preprocess(batch, rng)))


POOLS: Registry[ThreadPool | ProcessPool] = Registry("preprocess pool")
POOLS.register("thread")(ThreadPool)
POOLS.register("process")(ProcessPool)


# -- the pipeline ----------------------------------------------------------------------------------
class Pipeline:
    """This rank's batches from ``source``, read (Phases 1-2, I/O threads), preprocessed and
    staged (3-4, workers) ahead of ``next()`` (5; docs/data.md); errors raised by it in order."""

    def __init__(
        self,
        source: Any,
        batch_size: int,
        preprocess: Preprocess | None = None,
        io_threads: int = 1,
        workers: int = 2,
        buffers: int = 3,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        device: torch.device | str | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        pool: str = "thread",
        collate: Collate | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        for key, value in (("batch_size", batch_size), ("io_threads", io_threads),
                           ("workers", workers), ("buffers", buffers)):  # fmt: skip
            require(value >= 1, key, f"must be >= 1, got {value}")
        require(timeout_s > 0, "timeout_s", f"must be > 0, got {timeout_s}")
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self._owns_reader = isinstance(source, (str, os.PathLike))
        self.reader = as_reader(source, collate)
        self.order = GlobalOrder(
            len(self.reader), batch_size, self.rank, self.world_size, seed, shuffle, drop_last
        )
        if self.order.steps_per_epoch == 0:
            if self._owns_reader and hasattr(self.reader, "close"):
                self.reader.close()
            raise DataError(
                f"data.batch_size: global batch {self.order.global_batch} ({batch_size} x "
                f"{self.world_size} ranks) exceeds the {len(self.reader)} samples of "
                f"{self.reader.name}, so drop_last leaves no step"
            )
        self.batch_size, self.seed = batch_size, seed
        self.global_batch = self.order.global_batch
        self.steps_per_epoch = self.order.steps_per_epoch
        self.num_io_threads, self.num_workers, self.num_buffers = io_threads, workers, buffers
        self.timeout_s = timeout_s
        self._pool = POOLS.get(pool)(preprocess, workers) if preprocess is not None else None
        self._stage = make_device_stage(device)
        self.position = Position()
        self.last_wait_s = 0.0  # the time the last next() took (the input wait)
        self.last_ready = 0  # buffers ready when the last next() was called (occupancy)
        self._threads: list[threading.Thread] = []
        self._buffers: BatchBuffers | None = None
        self._work: queue.SimpleQueue[Slot | None] = queue.SimpleQueue()
        self._held: Slot | None = None
        self._next_seq = 0
        self._failure: BaseException | None = None
        self._closed = False

    # -- consumer -----------------------------------------------------------------------------
    def next(self) -> Batch:
        """The next batch of this rank; advances the position (and the epoch at its end)."""
        if self._closed:
            raise DataError("the input pipeline is closed")
        if self._buffers is None:
            self._start()
        buffers = self._buffers
        assert buffers is not None
        start = time.perf_counter()
        ready = buffers.num_ready
        # Phase 5: wait for this batch, then release the previous one's buffer. Releasing after
        # the take keeps the producers it wakes from competing for the GIL during the handover;
        # a single buffer must be released first (it is the only one).
        if self._held is not None and self.num_buffers == 1:
            buffers.release(self._held)
            self._held = None
        try:
            slot = buffers.take(self._next_seq, self.timeout_s)
        except PipelineClosed:
            self._raise_failure()
            raise
        except DataError:
            self.close()
            raise
        if slot.error is not None:
            error = slot.error
            self.close()
            raise error
        batch = self._stage.hand_over(slot.batch)
        slot.batch = None  # the caller owns the batch now: its memory goes when they drop it
        if self._held is not None:
            buffers.release(self._held)
        self._held, self._next_seq = slot, self._next_seq + 1
        self.last_wait_s, self.last_ready = time.perf_counter() - start, ready
        self.position = Position(slot.epoch, slot.step + 1)
        return batch

    def __iter__(self) -> Iterator[Batch]:
        """The rest of the current epoch (a whole new epoch if the current one is finished)."""
        remaining = self.steps_per_epoch - self.position.step
        for _ in range(remaining if remaining > 0 else self.steps_per_epoch):
            yield self.next()

    def __len__(self) -> int:
        return self.steps_per_epoch

    # -- position -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        return position_state(self.position, self.global_batch)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``; batches prepared ahead for the old position are dropped."""
        self._stop_threads()
        self.position = position_from_state(state, self.global_batch)

    # -- threads ------------------------------------------------------------------------------
    def _start(self) -> None:
        epoch, step = self.position.epoch, self.position.step
        base = epoch * self.steps_per_epoch + step  # global step of sequence number 0
        self._buffers = buffers = BatchBuffers(self.num_buffers)
        work: queue.SimpleQueue[Slot | None] = queue.SimpleQueue()
        self._work = work
        self._next_seq, self._failure = 0, None
        targets: list[tuple[str, Callable[..., None], tuple[Any, ...]]]
        targets = [(f"phalanx-io-{i}", self._io_loop, (buffers, work, base))
                   for i in range(self.num_io_threads)]  # fmt: skip
        targets += [(f"phalanx-worker-{i}", self._work_loop, (buffers, work))
                    for i in range(self.num_workers)]  # fmt: skip
        self._threads = [
            threading.Thread(target=fn, args=args, name=name, daemon=True)
            for name, fn, args in targets
        ]
        for thread in self._threads:
            thread.start()

    def _io_loop(self, buffers: BatchBuffers, work: queue.SimpleQueue, base: int) -> None:
        try:
            while (slot := buffers.claim()) is not None:
                # Phase 1: which samples.
                slot.epoch, slot.step = divmod(base + slot.seq, self.steps_per_epoch)
                try:
                    # Phase 2: read them into host memory.
                    slot.batch = self.reader.read(self.order.indices(slot.epoch, slot.step))
                except BaseException as e:
                    slot.error = e
                    buffers.publish(slot)
                    return
                work.put(slot)
        except BaseException as e:  # a bug outside any batch: fail the whole pipeline
            self._fail(e, buffers)

    def _work_loop(self, buffers: BatchBuffers, work: queue.SimpleQueue) -> None:
        try:
            while (slot := work.get()) is not None:
                try:
                    # Phase 3: preprocess.
                    batch = slot.batch
                    if self._pool is not None:
                        batch = self._pool.run(batch, self._rng(slot))
                    # Phase 4: toward the device.
                    slot.batch = self._stage.stage(batch, slot.index)
                except BaseException as e:
                    slot.error = e
                buffers.publish(slot)
        except BaseException as e:
            self._fail(e, buffers)

    def _rng(self, slot: Slot) -> np.random.Generator:
        seed = self.seed & 0xFFFF_FFFF_FFFF_FFFF  # SeedSequence takes non-negative ints
        return np.random.default_rng([seed, slot.epoch, slot.step, self.rank])

    def _fail(self, error: BaseException, buffers: BatchBuffers) -> None:
        self._failure = error
        buffers.close()

    def _raise_failure(self) -> None:
        failure = self._failure
        self.close()
        if failure is not None:
            raise failure

    def _stop_threads(self) -> None:
        """Close the buffers (waking every waiter), stop the workers, join every thread."""
        if self._buffers is not None:
            self._buffers.close()
        for _ in range(self.num_workers):
            self._work.put(None)
        for thread in self._threads:
            thread.join(JOIN_TIMEOUT_S)
        if stuck := [thread.name for thread in self._threads if thread.is_alive()]:
            warnings.warn(f"input pipeline: {', '.join(stuck)} still running", stacklevel=3)
        self._threads, self._buffers, self._held = [], None, None

    def close(self) -> None:
        """Stop every thread and worker process; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_threads()
        if self._pool is not None:
            self._pool.close()
        if self._owns_reader and hasattr(self.reader, "close"):
            self.reader.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values, else the process group's (phalanx.init), else the launcher's, else 0/1."""
    if (rank is None) != (world_size is None):
        raise ValueError("rank and world_size: pass both or neither")
    if rank is None or world_size is None:
        if dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        else:
            rank = int(os.environ.get("RANK", "0"))
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
    require(world_size >= 1, "world_size", f"must be >= 1, got {world_size}")
    require(0 <= rank < world_size, "rank", f"must be in [0, {world_size}), got {rank}")
    return rank, world_size
