"""The Engine's argument checks: one line per argument that cannot work, before anything is
built (wrapped models, sparse embeddings, what a pipeline or a memory manager cannot run with)."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.engine.config import StepConfig
from phalanx.engine.tracing import TraceConfig
from phalanx.errors import ConfigError
from phalanx.memory.manager import MemoryManager
from phalanx.parallel.layout import ParallelConfig
from phalanx.runtime.context import Context

AUTO = "auto"
# The Engine's optional keyword arguments: (their type, what to pass).
_KINDS: dict[str, tuple[type, str]] = {
    "step": (StepConfig, "a phalanx.engine.config.StepConfig (e.g. a run's [train])"),
    "memory": (MemoryManager, "a phalanx.memory.manager.MemoryManager or None"),
    "trace": (TraceConfig, "a phalanx.engine.tracing.TraceConfig or None"),
    "parallel": (ParallelConfig, "a phalanx.parallel.layout.ParallelConfig or None"),
    "context": (Context, "the Context of phalanx.init() or None"),
}


class PointToEngine:
    """Stands in for a DDP method on the user's model and names the Engine's (picklable: a
    whole-model ``torch.save`` still works)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(
            f"model.{self.name}: the model is not wrapped in DDP; use `with "
            f"engine.{self.name}():` around engine.step(...) (each step inside runs forward "
            "and backward only)"
        )


def check_arguments(model: Any, loss_fn: Any, optimizer: Any) -> None:
    """The positional arguments' kinds, one line each."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model: pass a torch.nn.Module; got {type(model).__name__}")
    refuse_wrapped(model)
    if optimizer is None:
        raise ConfigError(
            "optimizer: required; pass the optimizer built over model.parameters() or a "
            "factory params -> Optimizer"
        )
    if isinstance(loss_fn, type) and issubclass(loss_fn, torch.nn.Module):
        raise ConfigError(  # the class is callable too: its first step would fail inside torch
            f"loss_fn: pass an instance, {loss_fn.__name__}(), not the class {loss_fn.__name__}"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(
            f"loss_fn: pass a function (output, targets) -> loss, or None when the model "
            f"returns its own loss; got {type(loss_fn).__name__}"
        )
    for name, sub in model.named_modules():
        if getattr(sub, "sparse", False) is True and isinstance(
            sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)
        ):
            if sub.weight.requires_grad:
                raise ConfigError(
                    f"model: {name or 'the model'} ({type(sub).__name__}) has sparse=True, "
                    "whose sparse gradients phalanx does not exchange (its buckets are dense); "
                    "build it with sparse=False"
                )


def refuse_wrapped(model: torch.nn.Module) -> None:
    """A model another data-parallel wrapper still holds: its own hooks would exchange (and
    average) the gradients a second time, or shard what phalanx expects whole."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    wrappers = (
        torch.nn.parallel.DistributedDataParallel,
        torch.nn.DataParallel,
        FullyShardedDataParallel,
    )
    if isinstance(inner, wrappers):
        name = type(inner).__name__
        raise ConfigError(
            f"model: it is wrapped in {name}, which would exchange the gradients again; pass "
            f"the model itself (model.module), and drop the {name}(...) line"
        )
    if any(isinstance(m, FSDPModule) for m in inner.modules()):  # fully_shard's
        raise ConfigError(
            "model: fully_shard() was applied to it; pass the model before sharding (phalanx "
            "shards it itself with exchange='fsdp')"
        )


def check_pipeline(bucket_mb: float | str, loss_fn: Any, memory: Any, outputs: bool) -> None:
    """What pipeline > 1 cannot run with, one line each."""
    if bucket_mb == AUTO:
        raise ConfigError(
            "bucket_mb: 'auto' profiles one whole backward pass, which a pipeline "
            "splits over ranks; give a size in MiB with pipeline > 1"
        )
    if loss_fn is None:
        raise ConfigError(
            "loss_fn: pipeline > 1 computes the loss on the last stage from loss_fn; "
            "give one (the model's own loss works with pipeline = 1)"
        )
    if memory is not None:
        raise ConfigError(
            "memory: the memory manager works on one stage per model copy; use it with pipeline = 1"
        )
    if outputs:
        raise ConfigError(
            "return_outputs: with pipeline > 1 the outputs exist on the last stage's "
            "ranks only; compute what you need from them in loss_fn"
        )


def check_kinds(**arguments: Any) -> None:
    """One line per optional argument of the wrong type (None always passes)."""
    for name, value in arguments.items():
        kinds, wanted = _KINDS[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise ConfigError(f"{name}: pass {wanted}; got {type(value).__name__} {value!r:.60}")


def check_memory(memory: MemoryManager | None, device: torch.device, factory: Any) -> None:
    """A memory manager plans for one device, the Engine's (its tier and mirror depend on it);
    a strategy that shards the optimizer state over the ranks keeps it where its shards are."""
    if memory is None:
        return
    if memory.device is not None and memory.device.type != device.type:
        raise ConfigError(
            f"memory: the MemoryManager was built for {memory.device.type} but the Engine runs "
            f"on {device}; build it with the Engine's device (phalanx.init().device)"
        )
    if factory.cls.shards_parameters and memory.optimizer_place != "device":
        raise ConfigError(
            f"memory.optimizer: {factory.name!r} shards the optimizer state over the data ranks "
            "already; use memory.optimizer = 'device' (activation offload and recompute work)"
        )


def check_bucket_size(bucket_mb: float | str, factory: Any) -> None:
    """A strategy that exchanges each unit's gradients itself has no buckets to size."""
    if factory.cls.shards_parameters and bucket_mb == AUTO:
        raise ConfigError(
            f"bucket_mb: {factory.name!r} exchanges each unit's gradients itself, with "
            "no fusion buckets to size; leave bucket_mb at a size"
        )


def refuse_closed(closed: bool) -> None:
    """A step on a closed Engine (its hooks and threads are gone)."""
    if closed:
        raise ConfigError(
            "step: this Engine is closed (by close(), phalanx.shutdown(), "
            "dist.destroy_process_group() or the end of its with block); build a new Engine "
            "to train again"
        )
