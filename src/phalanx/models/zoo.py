"""Built-in models, registered by name, used by configs, benchmarks and tests."""

from __future__ import annotations

from torch import nn

from phalanx.models.layers import build_layers
from phalanx.registry import Registry

MODELS: Registry[nn.Module] = Registry("model")


def digits_cnn_layers(channels: int = 32, hidden: int = 128, dropout: float = 0.1) -> list[dict]:
    """The digits CNN as layer tables (input (B, 1, 8, 8) -> logits (B, 10))."""
    return [
        {"type": "conv2d", "in_channels": 1, "out_channels": channels, "kernel_size": 3,
         "padding": 1},
        {"type": "relu"},
        {"type": "conv2d", "in_channels": channels, "out_channels": 2 * channels,
         "kernel_size": 3, "padding": 1},
        {"type": "relu"},
        {"type": "maxpool2d", "kernel_size": 2},
        {"type": "flatten"},
        {"type": "linear", "in_features": 2 * channels * 16, "out_features": hidden},
        {"type": "relu"},
        {"type": "dropout", "p": dropout},
        {"type": "linear", "in_features": hidden, "out_features": 10},
    ]  # fmt: skip


@MODELS.register("digits_cnn")
def digits_cnn(channels: int = 32, hidden: int = 128, dropout: float = 0.1) -> nn.Module:
    """Small CNN for 8x8 digits: (B, 1, 8, 8) float32 -> (B, 10) logits."""
    return build_layers(digits_cnn_layers(channels, hidden, dropout))


@MODELS.register("mlp")
def mlp(
    in_features: int = 1024, hidden: int = 2048, num_hidden: int = 2, out_features: int = 10
) -> nn.Module:
    """MLP: (B, in_features) -> (B, out_features); defaults give 8.4M parameters."""
    sizes = [in_features] + [hidden] * num_hidden + [in_features, out_features]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)
