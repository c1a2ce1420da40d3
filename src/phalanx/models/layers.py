"""Layer types by name (F6), assembled in order into a network; a ``[[model.layers]]`` table's
arguments are checked against the constructor's signature when the config loads."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from phalanx.errors import ConfigError
from phalanx.fields import ConfigValueError, require
from phalanx.models.modes import evaluating
from phalanx.registry import Registry

LAYERS: Registry[nn.Module] = Registry("layer type")


class LSTMLayer(nn.LSTM):
    """``nn.LSTM`` that returns only the output sequence (B, T, H), so layers can follow it."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = True,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
    ) -> None:
        # the explicit signature is what a config's arguments are checked against
        args = (num_layers, bias, batch_first, dropout, bidirectional, proj_size)
        super().__init__(input_size, hidden_size, *args)

    # (torch's stubs differ across versions: the override is flagged by some, not others)
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override, unused-ignore]
        output, _ = cast(Any, super()).forward(x)
        return output


for _name, _cls in {
    "linear": nn.Linear,
    "conv1d": nn.Conv1d,
    "conv2d": nn.Conv2d,
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "maxpool2d": nn.MaxPool2d,
    "avgpool2d": nn.AvgPool2d,
    "adaptiveavgpool2d": nn.AdaptiveAvgPool2d,
    "flatten": nn.Flatten,
    "dropout": nn.Dropout,
    "layernorm": nn.LayerNorm,
    "batchnorm": nn.BatchNorm2d,
    "batchnorm1d": nn.BatchNorm1d,
    "batchnorm2d": nn.BatchNorm2d,
    "embedding": nn.Embedding,
    "lstm": LSTMLayer,
    "identity": nn.Identity,
}.items():
    LAYERS.register(_name)(_cls)


def _check_layer(spec: dict, key: str) -> None:
    layer_type = spec.get("type")
    require(isinstance(layer_type, str), f"{key}.type", "missing layer type")
    LAYERS.require_known(layer_type, f"{key}.type")
    _check_arguments(LAYERS.get(cast(str, layer_type)), layer_arguments(spec), key)


def _check_arguments(factory: Callable[..., Any], args: dict, key: str) -> None:
    signature = inspect.signature(factory)
    accepted = [
        name
        for name, p in signature.parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in ("device", "dtype")
    ]
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
    for name in args:
        if name not in accepted and not takes_kwargs:
            raise ConfigValueError(
                f"{key}.{name}", f"unknown argument; allowed: {', '.join(accepted)}"
            )
    try:
        signature.bind(**args)
    except TypeError as e:
        raise ConfigValueError(key, f"{e}; allowed arguments: {', '.join(accepted)}") from None
    if isinstance(factory, type):
        _try_build(factory, args, key)


def _try_build(cls: type, args: dict, key: str) -> None:
    """Construct on the meta device: bad arguments fail at config load, not mid-build."""
    try:
        with torch.device("meta"):
            cls(**args)
    except (TypeError, ValueError, RuntimeError) as e:
        reason = " ".join(str(e).split())
        raise ConfigValueError(key, f"invalid arguments for {cls.__name__}: {reason}") from None


NOT_ARGUMENTS = ("type", "stage")  # keys of a layer table that are not constructor arguments


def layer_arguments(spec: dict) -> dict:
    """A layer table's constructor arguments."""
    return {k: v for k, v in spec.items() if k not in NOT_ARGUMENTS}


def build_layers(layers: list[dict]) -> nn.Sequential:
    """An ``nn.Sequential`` of the configured layers, in order."""
    return nn.Sequential(*(LAYERS.get(s["type"])(**layer_arguments(s)) for s in layers))


def run_layers(
    model: nn.Module, layers: list[dict], inputs: torch.Tensor
) -> tuple[Any, ConfigError | None]:
    """``inputs`` through ``model`` layer by layer, in eval mode: (output, None), or (None, the
    error naming the first layer that raises, its input's shape and the fix)."""
    if not isinstance(model, nn.Sequential) or len(model) != len(layers):
        with evaluating(model), torch.no_grad():
            return model(inputs), None
    x = inputs
    with evaluating(model), torch.no_grad():
        for i, (layer, spec) in enumerate(zip(model, layers)):
            try:
                x = layer(x)
            except (RuntimeError, ValueError, IndexError) as e:
                said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                return None, ConfigError(
                    f"model.layers[{i}] ({spec['type']}): {said}; its input has shape {shape}: "
                    "set its sizes to match the layer before"
                )
    return x, None
