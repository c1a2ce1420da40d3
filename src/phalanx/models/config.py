"""The ``[model]`` config (F6): a built-in model by name or a list of layer tables."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from phalanx.fields import option, require
from phalanx.models import gpt  # noqa: F401 - registers the GPT layer types
from phalanx.models.layers import _check_arguments, _check_layer, build_layers
from phalanx.models.zoo import MODELS


@dataclass(kw_only=True)
class ModelConfig:
    """The network: a built-in model by ``name`` (with ``options``), or a list of ``layers``."""

    name: str = option("", "built-in model (see phalanx.models.MODELS); empty when layers given")
    options: dict = option(factory=dict, doc="keyword arguments of the built-in model")
    layers: list[dict] = option(factory=list, doc="layer tables: type + constructor arguments")

    def __post_init__(self) -> None:
        one = bool(self.name) != bool(self.layers)
        require(one, "name", "give exactly one of model.name or model.layers")
        if self.name:
            MODELS.require_known(self.name, "name")
            _check_arguments(MODELS.get(self.name), self.options, "options")
        require(not (self.layers and self.options), "options", "only used with model.name")
        for i, spec in enumerate(self.layers):
            _check_layer(spec, f"layers[{i}]")


def build_model(config: ModelConfig) -> nn.Module:
    """The nn.Module a ModelConfig describes."""
    if config.layers:
        return build_layers(config.layers)
    return MODELS.get(config.name)(**config.options)
