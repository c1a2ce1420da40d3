"""Models from config: every registered layer type builds and runs; built-in models' shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from phalanx.config import config_from_data, load_config
from phalanx.errors import ConfigError
from phalanx.models import LAYERS, MODELS, ModelConfig, build_model
from phalanx.models.zoo import digits_cnn_layers

ROOT = Path(__file__).resolve().parents[2]

# layer type -> (constructor arguments, input shape, expected output shape)
EXAMPLES: dict[str, tuple[dict, tuple[int, ...], tuple[int, ...]]] = {
    "linear": ({"in_features": 4, "out_features": 3}, (2, 4), (2, 3)),
    "conv1d": ({"in_channels": 2, "out_channels": 3, "kernel_size": 3}, (2, 2, 5), (2, 3, 3)),
    "conv2d": (
        {"in_channels": 1, "out_channels": 3, "kernel_size": 3, "padding": 1},
        (2, 1, 5, 5),
        (2, 3, 5, 5),
    ),
    "relu": ({}, (2, 4), (2, 4)),
    "gelu": ({"approximate": "tanh"}, (2, 4), (2, 4)),
    "tanh": ({}, (2, 4), (2, 4)),
    "sigmoid": ({}, (2, 4), (2, 4)),
    "maxpool2d": ({"kernel_size": 2}, (2, 1, 4, 4), (2, 1, 2, 2)),
    "avgpool2d": ({"kernel_size": 2}, (2, 1, 4, 4), (2, 1, 2, 2)),
    "adaptiveavgpool2d": ({"output_size": 1}, (2, 3, 4, 4), (2, 3, 1, 1)),
    "flatten": ({}, (2, 1, 2, 3), (2, 6)),
    "dropout": ({"p": 0.5}, (2, 4), (2, 4)),
    "layernorm": ({"normalized_shape": 4}, (2, 4), (2, 4)),
    "batchnorm": ({"num_features": 3}, (2, 3, 2, 2), (2, 3, 2, 2)),
    "batchnorm1d": ({"num_features": 3}, (2, 3), (2, 3)),
    "batchnorm2d": ({"num_features": 3}, (2, 3, 2, 2), (2, 3, 2, 2)),
    "embedding": ({"num_embeddings": 10, "embedding_dim": 4}, (2, 5), (2, 5, 4)),
    "lstm": ({"input_size": 4, "hidden_size": 6}, (2, 5, 4), (2, 5, 6)),
    "identity": ({}, (2, 4), (2, 4)),
    "gpt_embedding": ({"vocab_size": 10, "dim": 8, "max_seq_len": 6}, (2, 5), (2, 5, 8)),
    "transformer_block": ({"dim": 8, "num_heads": 2}, (2, 5, 8), (2, 5, 8)),
}
INTEGER_INPUTS = ("embedding", "gpt_embedding")


def model_from_layers(layers: list[dict]) -> nn.Module:
    return build_model(config_from_data({"model": {"layers": layers}}).model)


@pytest.mark.parametrize("layer_type", LAYERS.names())
def test_every_registered_layer_type_builds_and_runs(layer_type):
    assert layer_type in EXAMPLES, f"add an example for new layer type {layer_type!r}"
    args, in_shape, out_shape = EXAMPLES[layer_type]
    model = model_from_layers([{"type": layer_type, **args}])
    assert isinstance(model, nn.Sequential) and len(model) == 1
    assert isinstance(model[0], LAYERS.get(layer_type))
    if layer_type in INTEGER_INPUTS:
        x = torch.randint(0, 10, in_shape)
    else:
        x = torch.randn(in_shape)
    assert model(x).shape == out_shape


def test_layers_are_built_in_order():
    model = model_from_layers(
        [
            {"type": "linear", "in_features": 4, "out_features": 8},
            {"type": "tanh"},
            {"type": "linear", "in_features": 8, "out_features": 2, "bias": False},
        ]
    )
    assert [type(m) for m in model] == [nn.Linear, nn.Tanh, nn.Linear]
    assert model[2].bias is None and model[0].out_features == 8


def test_digits_cnn_output_shape():
    model = build_model(ModelConfig(name="digits_cnn"))
    assert model(torch.randn(5, 1, 8, 8)).shape == (5, 10)


def test_digits_cnn_options():
    model = build_model(ModelConfig(name="digits_cnn", options={"channels": 4, "hidden": 16}))
    assert model(torch.randn(3, 1, 8, 8)).shape == (3, 10)
    assert model[0].out_channels == 4


def test_example_config_model_is_the_zoo_digits_cnn():
    config = load_config(ROOT / "configs" / "digits_cnn.toml")
    assert config.model.layers == digits_cnn_layers()
    from_file = build_model(config.model)
    from_zoo = MODELS.get("digits_cnn")()
    assert from_file(torch.randn(4, 1, 8, 8)).shape == (4, 10)
    count = sum(p.numel() for p in from_file.parameters())
    assert count == sum(p.numel() for p in from_zoo.parameters())


def test_mlp_is_large_enough_for_exchange_benchmarks():
    model = build_model(ModelConfig(name="mlp"))
    assert sum(p.numel() for p in model.parameters()) >= 5_000_000
    assert model(torch.randn(2, 1024)).shape == (2, 10)


def test_mlp_options():
    model = build_model(
        ModelConfig(name="mlp", options={"in_features": 6, "hidden": 5, "out_features": 3})
    )
    assert model(torch.randn(2, 6)).shape == (2, 3)
    assert not isinstance(list(model)[-1], nn.ReLU)  # logits, no activation at the end


def test_lstm_layer_returns_the_sequence_only():
    model = model_from_layers(
        [
            {"type": "lstm", "input_size": 3, "hidden_size": 7, "num_layers": 2},
            {"type": "linear", "in_features": 7, "out_features": 4},
        ]
    )
    lstm = model[0]
    assert lstm.batch_first
    out = lstm(torch.randn(2, 5, 3))
    assert isinstance(out, torch.Tensor) and out.shape == (2, 5, 7)
    assert model(torch.randn(2, 5, 3)).shape == (2, 5, 4)


def test_unknown_lstm_argument_is_a_config_error():
    layer = {"type": "lstm", "input_size": 3, "hidden_size": 4, "foo": 1}
    with pytest.raises(ConfigError, match=r"^model\.layers\[0\]\.foo: unknown argument"):
        config_from_data({"model": {"layers": [layer]}})


def test_transformer_block_is_causal():
    torch.manual_seed(0)
    block = model_from_layers([{"type": "transformer_block", "dim": 8, "num_heads": 2}]).eval()
    x = torch.randn(1, 6, 8)
    changed = x.clone()
    changed[:, 4:] += 1.0  # later positions must not affect earlier outputs
    with torch.no_grad():
        torch.testing.assert_close(block(x)[:, :4], block(changed)[:, :4])
        assert not torch.allclose(block(x)[:, 4:], block(changed)[:, 4:])
    with pytest.raises(ConfigError, match="dim 8 is not divisible by num_heads 3"):
        model_from_layers([{"type": "transformer_block", "dim": 8, "num_heads": 3}])


def test_a_configs_model_silences_fsdps_view_warning_only() -> None:
    """FSDP2 warns that an in-place op on a unit's view output would skip its all-gather;
    phalanx's layers never do that, so a config's model (build.model) silences exactly that
    warning and no other."""
    import warnings

    from phalanx import build

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build.model(load_config("configs/digits_cnn.toml"))
        warnings.warn(
            "FSDP2-wrapped module (FSDPLSTMLayer) returned a view tensor. An in-place op ...",
            UserWarning,
            stacklevel=1,
        )
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else"]
