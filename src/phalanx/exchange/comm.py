"""A background communication thread with its own process group (docs/exchange.md)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist


class CommThread:
    """Runs submitted jobs in order on a daemon thread (CUDA: a side stream that waits)."""

    def __init__(
        self,
        device: torch.device,
        like: Any = None,
        name: str = "phalanx-comm",
        own_group: bool = True,
    ) -> None:
        # own_group False: no process group (jobs that do not communicate: the hand-off probe)
        self.group = mirror_group(like) if own_group else None
        self.device = device
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> Future:
        future: Future = Future()
        event = None
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record()
        self._jobs.put((job, future, event))
        return future

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, future, event = item
            try:
                future.set_result(self._run(job, event))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(e)

    def _run(self, job: Callable[[], Any], event: Any) -> Any:
        if self._stream is None:
            return job()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(event)
            result = job()
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return result

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=5)
        self.group = None  # the group may go at shutdown (its worker threads joined)


def global_rank(group: Any, rank: int) -> int:
    """The world rank of ``rank`` within ``group`` (p2p takes world ranks before torch 2.6)."""
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def mirror_group(group: Any = None) -> Any:
    """A new process group of ``group``'s members in order, created by its members only."""
    ranks = None if group is None else dist.get_process_group_ranks(group)
    if ranks is None or len(ranks) == dist.get_world_size():
        return dist.new_group(backend=dist.get_backend())
    return dist.new_group(ranks=ranks, backend=dist.get_backend(), use_local_synchronization=True)


def wait_all(works: list[Any]) -> None:
    """Wait for backend Works (None only on a rank outside the group)."""
    for work in works:
        assert work is not None
        work.wait()


def wait(handle: Any) -> None:
    """Wait for a backend Work or a CommThread Future (its exception is re-raised here)."""
    if isinstance(handle, Future):
        handle.result()
    else:
        handle.wait()


HANDOFF_REPEATS = 200  # ~0.3 s
HANDOFF_WORK_S = 5e-4  # the job's work
HANDOFF_PAUSE_S = 1e-3  # the compute thread's work between jobs (the other thread sleeps)
PROBE_MATRIX = 160  # the probe's work: matrix products of this size (~0.1 ms on a CPU core)


def measure_handoff_s(
    repeats: int = HANDOFF_REPEATS, work_s: float = HANDOFF_WORK_S, pause_s: float = HANDOFF_PAUSE_S
) -> tuple[float, ...]:
    """Latencies (s) of handing a job to a sleeping ``CommThread`` and of resuming after it,
    the threads busy with CPU matrix products (GIL free, as in backward); docs/planner.md.
      Phase 1 (warm-up): two hand-overs, so the thread and its queue exist.
      Phase 2 (probe): ``repeats`` hand-overs, each after ``pause_s`` of the submitter's work."""
    comm = CommThread(torch.device("cpu"), own_group=False, name="phalanx-handoff-probe")
    n = PROBE_MATRIX
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = {name: torch.empty(n, n) for name in ("compute", "comm")}

    def work(seconds: float, name: str) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            torch.mm(a, b, out=out[name])

    def job() -> tuple[float, float]:
        started = time.perf_counter()
        work(work_s, "comm")
        return started, time.perf_counter()

    samples: list[float] = []
    try:
        for i in range(repeats + 2):
            work(pause_s, "compute")
            submitted = time.perf_counter()
            future = comm.submit(job)
            started, ended = future.result()
            resumed = time.perf_counter()
            if i >= 2:  # Phase 1 done
                samples += [started - submitted, resumed - ended]
    finally:
        comm.close()
    return tuple(samples)


PACK_ALIGN = 16  # bytes: every tensor starts aligned in the packed buffer, so views are legal


@torch.no_grad()
def broadcast_together(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Rank 0's values of ``tensors`` (one device) on every rank in one packed broadcast."""
    start_broadcast_together(tensors, group)()


def start_broadcast_together(
    tensors: list[torch.Tensor], group: dist.ProcessGroup
) -> Callable[[], None]:
    """``broadcast_together`` started; returns the function that waits and writes it in."""
    if not tensors or dist.get_world_size(group) == 1:
        return lambda: None
    sizes = [t.numel() * t.element_size() for t in tensors]
    padded = [-(-n // PACK_ALIGN) * PACK_ALIGN for n in sizes]
    packed = torch.zeros(sum(padded), dtype=torch.uint8, device=tensors[0].device)
    offset = 0
    for tensor, size, room in zip(tensors, sizes, padded):
        packed[offset : offset + size] = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        offset += room
    work = dist.broadcast(packed, src=dist.get_global_rank(group, 0), group=group, async_op=True)
    assert work is not None  # async_op=True (torch 2.14's stubs allow None)

    def finish() -> None:
        work.wait()
        offset = 0
        for tensor, size, room in zip(tensors, sizes, padded):
            piece = packed[offset : offset + size].view(tensor.dtype).view(tensor.shape)
            tensor.data.copy_(piece)
            offset += room

    return finish
