"""``[train] compile``: torch.compile per layer, with phalanx's hooks outside the compiled code.

Each layer's ``forward`` is compiled in place (``layer.forward = torch.compile(layer.forward)``),
not the module's whole ``__call__`` (``nn.Module.compile``): the forward pre-hooks phalanx puts
on a layer (owner strategies and the host mirror waiting for parameters, the activation
offloader's layer marks, the pipeline's busy clock) then run eagerly around the compiled code
instead of being traced into it, where waiting on a background transfer is a graph break and a
changing dict a recompile each step. Parameters stay the same objects, so the Engine's
post-accumulate-grad hooks fire from the compiled backward as from an eager one. A layer is a
top-level child of the model (the children of a ModuleList / ModuleDict, which have no forward
of their own); a model without children is compiled whole.

Inside a compiled layer no submodule waits for its own parameters: ``forward_waiters`` makes the
layer wait for its whole subtree before its compiled forward starts.

``CompileClock`` measures the time torch spends compiling (Dynamo's compile callbacks, the lazy
backward compile included), which the Engine reports as ``compile_s``.
"""

from __future__ import annotations

import copy
import time
import types
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from phalanx.errors import ConfigError
from phalanx.optional import torch_quiet

# Layers whose forward this module compiled (weak: a dropped model leaves no trace here).
_COMPILED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
# Containers without a forward of their own: their children are the layers.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
# (layer class, forward, parameter shapes) -> its compiled frames' code (_compiled_forward).
_CODES: dict[tuple[type, Any, tuple], types.CodeType] = {}


def layers_of(module: nn.Module) -> list[nn.Module]:
    """The units compiled one by one: the top-level children (through containers)."""
    children = list(module.children())
    if not children:
        return [module]
    units: list[nn.Module] = []
    for child in children:
        units += layers_of(child) if isinstance(child, _CONTAINERS) else [child]
    return units


def compile_layers(module: nn.Module) -> list[nn.Module]:
    """Compile each layer's forward in place (once; static shapes, a new shape recompiles;
    run with gradients: forwards without them stay eager); returns the layers compiled."""
    _check_compilable(module)
    layers = [layer for layer in layers_of(module) if layer not in _COMPILED]
    for layer in layers:
        layer.forward = _compiled_forward(layer)
        _COMPILED.add(layer)
    return layers


def _check_compilable(module: nn.Module) -> None:
    """What per-layer compilation cannot take, one line each."""
    with torch_quiet():  # its import's warnings would precede the one-line errors below
        import torch._dynamo  # what torch.compile loads anyway; not at phalanx's import

    if not torch._dynamo.is_dynamo_supported():
        raise ConfigError(
            f"train.compile: torch.compile does not run with torch {torch.__version__} on this "
            "Python; set compile = false"
        )
    # Compiled whole, the model's (or a module's) hooks would be traced into the compiled
    # code, and each layer compiled a second time inside it.
    whole = isinstance(module, torch._dynamo.eval_frame.OptimizedModule) or any(
        getattr(sub, "_compiled_call_impl", None) is not None for sub in module.modules()
    )
    if whole:
        raise ConfigError(
            "train.compile: the model is already compiled (torch.compile(model) or "
            "module.compile()); pass the module itself: compile = true compiles it layer by layer"
        )


def _compiled_forward(layer: nn.Module) -> Any:
    """``layer.forward`` under torch.compile, through a frame whose code is this layer kind's
    own. Dynamo keeps compiled graphs (and its limit of 8 per code) on the code object of the
    frame it compiles; torch's own layers (``nn.Linear``) and wrapped forwards (a recomputed
    layer's) would all share one such code, and a model's layers x shapes x grad modes
    would fill it, after which torch runs them eagerly. Layers of one kind and parameter
    shapes (a model's transformer blocks) share the code, hence the graphs (parameters are
    the graphs' inputs)."""
    forward = layer.forward

    def call(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    shapes = tuple((name, p.shape, p.dtype) for name, p in layer.named_parameters())
    kind = (type(layer), getattr(forward, "__func__", forward), shapes)
    if kind not in _CODES:
        _CODES[kind] = call.__code__.replace(co_name=f"compiled_{type(layer).__name__}")
    call.__code__ = _CODES[kind]
    # Static shapes: a training step's shapes repeat, and dynamic ones compile slower.
    return _TrainCompiled(forward, torch.compile(call, dynamic=False))


class _TrainCompiled:
    """A layer's forward: compiled with gradients; eager without them (validation, export:
    compiling those graphs too would double the compile time for a few forwards). A copy of
    the layer (deepcopy, pickle) gets the eager forward, bound to the copy."""

    def __init__(self, forward: Any, compiled: Any) -> None:
        self.forward, self.compiled = forward, compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            return self.compiled(*args, **kwargs)
        return self.forward(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        return copy.deepcopy(self.forward, memo)  # a bound method: bound to the layer's copy

    def __reduce__(self) -> tuple:
        return _eager, (self.forward,)


def _eager(forward: Any) -> Any:
    return forward


def is_compiled(module: nn.Module) -> bool:
    return module in _COMPILED


def forward_waiters(
    module: nn.Module, subtree: bool = True
) -> Iterator[tuple[nn.Module, list[nn.Parameter]]]:
    """The submodules that wait for parameters in a forward pre-hook, each with the parameters
    it waits for: every submodule holding parameters, for its own (``subtree``: its subtree's,
    as it may read its children's without calling them), except inside a compiled layer, which
    waits for its whole subtree before its compiled forward starts (a hook inside it would be
    traced into the compiled code)."""
    if is_compiled(module):
        yield module, list(module.parameters())
        return
    if next(module.parameters(recurse=False), None) is not None:
        yield module, list(module.parameters(recurse=subtree))
    for child in module.children():
        yield from forward_waiters(child, subtree)


class CompileClock:
    """Seconds torch spent compiling (Dynamo traces, Inductor, the lazy backward compile)
    inside ``measure()`` blocks, and how many compilations that was."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count = 0
        self._started = 0.0

    def _start(self, *args: Any) -> None:  # torch 2.11 and 2.13 pass CallbackArgs
        self._started = time.perf_counter()

    def _end(self, *args: Any) -> None:
        self.seconds += time.perf_counter() - self._started
        self.count += 1

    @contextmanager
    def measure(self) -> Iterator[None]:
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        try:
            yield
        finally:
            callback_handler.remove_start_callback(self._start)
            callback_handler.remove_end_callback(self._end)
