"""Models from config files (F6): a registry of layer types and of built-in models."""

from phalanx.models.config import ModelConfig, build_model
from phalanx.models.layers import LAYERS
from phalanx.models.zoo import MODELS

__all__ = ["LAYERS", "MODELS", "ModelConfig", "build_model"]
