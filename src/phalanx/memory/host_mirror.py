"""F19 as the document builds it: fp32 masters, the optimizer's state and step on the host;
gradients stream out chunk by chunk, parameters back (an elementwise optimizer; docs/memory.md,
``mirror``, has the phases)."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch

from phalanx.compile import forward_waiters
from phalanx.errors import ConfigError
from phalanx.memory.residency import StepMirror


class HostMirror(StepMirror):
    """The optimizer's master parameters, state and arithmetic on the host (module docstring)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        module: torch.nn.Module | None,
        chunk_bytes: int,
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes: must be >= 1, got {chunk_bytes}")
        self.optimizer = optimizer
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.pin = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.pin else None
        self.num_chunks_stepped = 0
        self.num_resident = 0  # resident() blocks entered (checkpoints, sharded rebuilds)
        self._module = module
        self._hooks: list[Any] = []
        self._ready: list[Future] = []  # per chunk, this step: Phase 3 queued (or its error)
        self._ready_events: list[Any] = []  # per chunk: CUDA event after its parameters' copy
        self._waited: set[int] = set()  # chunks the compute stream already waits for
        self._worker: threading.Thread | None = None
        self._early: set[int] = set()  # parameters whose gradient is on its way already
        self._early_factor = 1.0  # scaling applied on the device after those copies started
        self.num_early_copies = 0
        self.evict()
        self._take_step()

    # -- taking the optimizer over --------------------------------------------------------------
    def evict(self) -> None:
        """Masters from the device parameters, the host optimizer over them with the device
        optimizer's state moved in (fp32 where it has the parameter's shape)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        kept = dict(zip(map(id, getattr(self, "params", [])), getattr(self, "masters", [])))
        self.params = params
        self.masters = [self._master(p, kept.get(id(p))) for p in params]
        self.grads = [self._host_like(p, copy=False) for p in params]
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": self.masters[i : i + n]}
            for g, i, n in _group_slices(self.optimizer.param_groups)
        ]
        self.host = _same_optimizer(self.optimizer, groups)
        for p, m in zip(params, self.masters):
            state = self.optimizer.state.pop(p, None)
            if state:
                self.host.state[m] = {k: _to_host(v, p) for k, v in state.items()}
        self.optimizer.state.clear()
        self._index = {id(p): i for i, p in enumerate(params)}
        self.chunks = _chunks(params, self.chunk_bytes)
        self._chunk_of = {id(params[i]): c for c, idx in enumerate(self.chunks) for i in idx}
        self._ready, self._ready_events, self._waited = [], [], set()
        if self._module is not None:
            self._register_hooks(self._module)

    def _master(self, p: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
        """The fp32 master of ``p``: the one kept from before ``resident()`` while ``p`` holds it
        rounded (bf16/fp16 keep fp32 precision across checkpoints), else a copy of ``p``."""
        if kept is not None and kept.shape == p.shape:
            if torch.equal(kept.to(p.dtype), p.detach().cpu()):
                return kept
        return self._host_like(p, copy=True)

    def _host_like(self, p: torch.Tensor, copy: bool) -> torch.Tensor:
        out = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=self.pin)
        if copy:
            out.copy_(p.detach())
        return out

    @property
    def defers(self) -> bool:
        """Whether forward pre-hooks wait for the parameters (the optimizer steps the module's
        own parameters), so Phases 2-3 overlap the next forward."""
        return bool(self._hooks)

    def _register_hooks(self, module: torch.nn.Module) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        own = {id(p) for p in module.parameters()}
        if not all(id(p) in own for p in self.params):
            return  # shard tensors: step() finishes the update itself
        for sub, params in forward_waiters(module, subtree=False):  # compiled: its subtree's
            if chunks := sorted({self._chunk_of[id(p)] for p in params}):
                self._hooks.append(sub.register_forward_pre_hook(partial(self._wait, chunks)))
        for sub in module.modules():
            if chunks := sorted({self._chunk_of[id(p)] for p in sub.parameters(recurse=False)}):
                self._hooks.append(sub.register_state_dict_pre_hook(partial(self._wait, chunks)))

    def _wait(self, chunks: list[int], *hook_args: Any) -> None:
        """A module's pre-hook: wait for the chunks holding its parameters."""
        for c in chunks:
            self._wait_chunk(c)

    # -- gradients as the exchange finishes them ----------------------------------------------
    def listen(self, strategy: Any) -> None:
        """Copy each bucket's gradients to the host as its exchange ends (allreduce, tree)."""
        if self.defers:
            strategy.bucket_listeners.append(lambda bucket: self.gradients_ready(bucket.params))

    def begin_step(self) -> None:
        """A new step: copies from a step that did not update (a skipped one) are void."""
        self._early.clear()
        self._early_factor = 1.0

    def gradients_ready(self, params: list[torch.Tensor]) -> None:
        """Phase 1 ahead of ``step``: queue these parameters' gradients for the host now."""
        self.sync()  # the previous step's host work reads the same buffers
        indices = [self._index[id(p)] for p in params if id(p) in self._index]
        indices = [i for i in indices if self.params[i].grad is not None]
        if not indices:
            return
        self._copy_gradients(indices)
        self._early.update(indices)
        self.num_early_copies += len(indices)

    def scale_gradients(self, factor: float) -> None:
        """The Engine scaled the exchanged gradients on the device (clipping, fp16 unscaling)
        after some were copied: the host scales those copies the same way before stepping."""
        self._early_factor *= factor

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> None:
        self.sync()  # the previous step's chunks (normally long done by now)
        # Phase 1: hyperparameters, then every chunk's gradients on their way to the host.
        for host_group, group in zip(self.host.param_groups, self.optimizer.param_groups):
            host_group.update({k: v for k, v in group.items() if k != "params"})
        has_grad = [p.grad is not None for p in self.params]
        early, factor = set(self._early), self._early_factor  # scaled on the host in Phase 2
        self.begin_step()
        grad_events = [
            self._copy_gradients([i for i in idx if has_grad[i] and i not in early])
            for idx in self.chunks
        ]
        if self.copy_stream is not None:  # nothing rewrites a gradient before it is copied
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        self._ready = [Future() for _ in self.chunks]
        self._ready_events = [None] * len(self.chunks)
        self._waited = set()
        if self.defers:
            self._worker = threading.Thread(
                target=self._step_chunks, args=(grad_events, has_grad, early, factor), daemon=True
            )
            self._worker.start()
            return
        self._step_chunks(grad_events, has_grad, early, factor)
        self.sync()

    def _copy_gradients(self, indices: list[int]) -> Any:
        """Queue the gradients of ``indices`` into their fp32 host buffers; returns the copy
        stream's event after them (None on the CPU, where the copies are done)."""
        if self.copy_stream is None:
            for i in indices:
                self.grads[i].copy_(self.params[i].grad)
            return None
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            for i in indices:
                self.grads[i].copy_(self.params[i].grad, non_blocking=True)
            return _record(self.copy_stream)

    def _step_chunks(
        self, grad_events: list[Any], has_grad: list[bool], early: set[int], factor: float
    ) -> None:
        """Phases 2-3 for every chunk; ``early``: gradients copied as their bucket finished;
        ``factor``: what the device scaled them by afterwards."""
        for c, idx in enumerate(self.chunks):
            try:
                # Phase 2: this chunk's gradients are on the host; step it alone.
                stepping = [i for i in idx if has_grad[i]]
                if grad_events[c] is not None:
                    grad_events[c].synchronize()
                for i in stepping:
                    if i in early and factor != 1.0:
                        self.grads[i].mul_(factor)
                if stepping:
                    for i in stepping:
                        self.masters[i].grad = self.grads[i]
                    try:
                        self._original_host_step()
                    finally:
                        for i in stepping:
                            self.masters[i].grad = None
                    self.num_chunks_stepped += 1
                    # Phase 3: the updated masters back into the device parameters.
                    self._ready_events[c] = self._queue_parameters(stepping)
            except BaseException as e:  # every waiter of this and later chunks sees it
                for future in self._ready[c:]:
                    future.set_exception(e)
                return
            self._ready[c].set_result(None)

    def _original_host_step(self) -> None:
        with torch.no_grad():
            self.host.step()

    def _queue_parameters(self, idx: list[int]) -> Any:
        if self.copy_stream is None:
            with torch.no_grad():
                for i in idx:
                    self.params[i].copy_(self.masters[i])
            return None
        with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
            with torch.no_grad():
                for i in idx:
                    self.params[i].copy_(self.masters[i], non_blocking=True)
            return _record(self.copy_stream)

    # -- waiting --------------------------------------------------------------------------------
    def _wait_chunk(self, c: int) -> None:
        if c in self._waited or c >= len(self._ready):
            return
        self._ready[c].result()  # re-raises the worker's error
        event = self._ready_events[c]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        self._waited.add(c)

    def sync(self) -> None:
        """Wait until every parameter holds its updated value (the compute stream orders after
        every copy)."""
        for c in range(len(self._ready)):
            self._wait_chunk(c)
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    # -- outside the step -----------------------------------------------------------------------
    def materialize(self) -> None:
        """The host state into the device optimizer, on the parameters' device (fp32 kept)."""
        self.sync()
        for p, m in zip(self.params, self.masters):
            state = self.host.state.get(m)
            if state:
                self.optimizer.state[p] = {
                    k: v.to(p.device) if torch.is_tensor(v) and v.dim() > 0 else v
                    for k, v in state.items()
                }
        self.host.state.clear()

    def lazy_shards(self, params: list[Any]) -> None:
        """The host's state is in memory already: checkpoints read it through ``resident``."""
        del params

    def stored_bytes(self) -> int:
        """Bytes the mirror holds on the host: masters, gradient buffers and optimizer state."""
        state = sum(
            v.numel() * v.element_size()
            for s in self.host.state.values()
            for v in s.values()
            if torch.is_tensor(v)
        )
        return state + sum(4 * m.numel() for m in self.masters) * 2

    def close(self) -> None:
        """Wait for the last step, hand the optimizer back its state and ``step``, remove the
        hooks (at interpreter exit the state stays on the host)."""
        try:
            self.materialize()
        except RuntimeError as e:
            if "shutdown" not in str(e) and "interpreter" not in str(e):
                raise
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._release_step()


def _record(stream: Any) -> Any:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _to_host(value: Any, param: torch.Tensor) -> Any:
    """A state value on the host: tensors shaped like the parameter in fp32 (the master's
    dtype), scalars (Adam's step) as they are."""
    if not torch.is_tensor(value):
        return value
    if value.shape == param.shape and value.is_floating_point():
        return value.detach().to("cpu", torch.float32, copy=True)
    return value.detach().to("cpu", copy=True)


def _group_slices(groups: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], int, int]]:
    start = 0
    for g in groups:
        yield g, start, len(g["params"])
        start += len(g["params"])


def _chunks(params: list[torch.Tensor], chunk_bytes: int) -> list[list[int]]:
    """Consecutive parameter indices, about ``chunk_bytes`` of fp32 masters per chunk."""
    chunks: list[list[int]] = []
    size = chunk_bytes
    for i, p in enumerate(params):
        if size >= chunk_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(i)
        size += 4 * p.numel()
    return chunks


def _same_optimizer(
    optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and hyperparameters over ``groups`` (host)."""
    defaults = dict(optimizer.defaults)
    if defaults.get("capturable"):  # graph capture is a device feature; the host steps eagerly
        defaults["capturable"] = False
        for g in groups:
            g["capturable"] = False
    if defaults.get("fused"):  # the host steps the masters with the CPU kernels
        defaults["fused"] = None
        for g in groups:
            g["fused"] = None
    # Groups carry every hyperparameter; the constructor gets the defaults it accepts (AdamW
    # fixes some of Adam's itself).
    accepted = inspect.signature(type(optimizer).__init__).parameters
    if not any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values()):
        defaults = {k: v for k, v in defaults.items() if k in accepted}
    try:
        return type(optimizer)(groups, **defaults)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(
            f"memory.optimizer: the host mirror builds a {type(optimizer).__name__} over host "
            f"copies of the parameters as {type(optimizer).__name__}(param_groups, "
            f"**defaults), which failed: {e}"
        ) from e
