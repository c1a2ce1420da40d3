"""Models from config files (F6): a registry of layer types and of built-in models."""

from phalanx.models import gpt  # noqa: F401 - registers the GPT layer types
from phalanx.models.layers import LAYERS, ModelConfig, build_model
from phalanx.models.zoo import MODELS

__all__ = ["LAYERS", "MODELS", "ModelConfig", "build_model"]
