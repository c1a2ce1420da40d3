"""RunConfig: the example config loads, --set overrides apply, and every mistake is a one-line
ConfigError that names the key path and what is allowed."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from phalanx.config import RunConfig, config_from_data, load_config
from phalanx.errors import ConfigError
from phalanx.models.layers import LAYERS
from phalanx.registry import Registry

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "configs" / "digits_cnn.toml"


def config_error(path: str | Path | None = EXAMPLE, overrides: list[str] | None = None) -> str:
    """The message of the ConfigError that loading raises; asserts it is one line."""
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert message and "\n" not in message, f"not a single line: {message!r}"
    return message


def data_error(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_data(data)
    message = str(info.value)
    assert message and "\n" not in message, f"not a single line: {message!r}"
    return message


# -- loading -------------------------------------------------------------------------------------


def test_example_config_loads_with_its_values():
    config = load_config(EXAMPLE)
    assert isinstance(config, RunConfig)
    assert config.model.name == ""
    assert [layer["type"] for layer in config.model.layers][:2] == ["conv2d", "relu"]
    assert len(config.model.layers) == 10
    assert config.model.layers[6] == {"type": "linear", "in_features": 1024, "out_features": 128}
    assert (config.data.source, config.data.batch_size, config.data.val_fraction) == (
        "digits",
        32,
        0.2,
    )
    assert (config.train.epochs, config.train.val_every, config.train.steps) == (15, 100, 0)
    assert (config.optimizer.name, config.optimizer.lr, config.optimizer.momentum) == (
        "sgd",
        0.05,
        0.9,
    )
    assert (config.exchange.strategy, config.exchange.bucket_mb) == ("allreduce", 25.0)
    assert (config.checkpoint.every, config.checkpoint.keep) == (200, 2)
    assert (config.runtime.threads, config.runtime.timeout_s) == (1, 300.0)
    assert isinstance(config.runtime.timeout_s, float)  # TOML int 300 converted to float


def test_defaults_without_a_file():
    config = load_config()
    assert config.model.name == "digits_cnn" and config.model.layers == []
    assert config.exchange.strategy == "allreduce"
    assert config.data.source == "digits"


def test_to_dict_round_trips_through_config_from_data():
    config = load_config(EXAMPLE, ["train.steps=5", "optimizer.name=adam"])
    again = config_from_data(config.to_dict())
    assert again == config


@pytest.mark.parametrize(
    ("item", "section", "key", "expected"),
    [
        ("train.steps=5", "train", "steps", 5),
        ("exchange.strategy=allreduce", "exchange", "strategy", "allreduce"),
        ('exchange.strategy="allreduce"', "exchange", "strategy", "allreduce"),
        ("optimizer.lr=0.1", "optimizer", "lr", 0.1),
        ("optimizer.lr=1", "optimizer", "lr", 1.0),
        ("optimizer.name=adamw", "optimizer", "name", "adamw"),
        ("train.progress=false", "train", "progress", False),
        ("data.shuffle=false", "data", "shuffle", False),
        ("train.run_dir=runs/tiny", "train", "run_dir", "runs/tiny"),
        ("train.run_dir='a dir/x'", "train", "run_dir", "a dir/x"),
        ("exchange.bucket_mb=2.5", "exchange", "bucket_mb", 2.5),
        ("runtime.backend=gloo", "runtime", "backend", "gloo"),
        (" data.batch_size = 8 ", "data", "batch_size", 8),
    ],
)
def test_set_overrides(item, section, key, expected):
    config = load_config(EXAMPLE, [item])
    value = getattr(getattr(config, section), key)
    assert value == expected
    assert type(value) is type(expected)


def test_later_override_wins_and_others_keep_file_values():
    config = load_config(EXAMPLE, ["train.steps=5", "train.steps=7"])
    assert config.train.steps == 7
    assert config.train.epochs == 15  # untouched value from the file


def test_overrides_do_not_mutate_the_input_tables():
    data = {"train": {"steps": 3}}
    before = copy.deepcopy(data)
    config = config_from_data(data, ["train.steps=9", "optimizer.lr=0.5"])
    assert config.train.steps == 9 and config.optimizer.lr == 0.5
    assert data == before


# -- errors: keys, types, values ------------------------------------------------------------------


def test_unknown_section_lists_sections():
    message = config_error(overrides=["foo.bar=1"])
    assert message.startswith("foo: unknown key")
    sections = (
        "checkpoint, data, exchange, log, memory, model, optimizer, parallel, runtime, "
        "scheduler, trace, train"
    )
    assert f"allowed: {sections}" in message


def test_unknown_key_lists_allowed_keys():
    message = config_error(overrides=["train.lr=0.1"])
    assert message.startswith("train.lr: unknown key")
    allowed = message.split("allowed: ", 1)[1].split(", ")
    assert {"steps", "epochs", "seed", "val_every"} <= set(allowed)
    assert "lr" not in allowed


def test_unknown_key_in_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[data]\nbatchsize = 8\n")
    message = config_error(path)
    assert message.startswith("data.batchsize: unknown key")
    assert "batch_size" in message


@pytest.mark.parametrize(
    ("item", "fragments"),
    [
        ("train.steps='5'", ["train.steps:", "expected int", "string"]),
        ("train.steps=true", ["train.steps:", "expected int", "bool"]),
        ("train.steps=5.0", ["train.steps:", "expected int", "float"]),
        ("train.steps=[1]", ["train.steps:", "expected int", "list"]),
        ("train.progress=1", ["train.progress:", "expected bool", "int"]),
        ("optimizer.lr='fast'", ["optimizer.lr:", "expected float", "string"]),
        ("optimizer.lr=true", ["optimizer.lr:", "expected float", "bool"]),
        ("data.source=3", ["data.source:", "expected str", "int"]),
        ("train.steps.x=1", ["train.steps:", "expected int", "table"]),
    ],
)
def test_wrong_type_names_key_and_types(item, fragments):
    message = config_error(overrides=[item])
    assert message.startswith(fragments[0])
    for fragment in fragments[1:]:
        assert fragment in message


def test_section_that_is_not_a_table():
    assert data_error({"train": 3}).startswith("train: expected a table")


@pytest.mark.parametrize(
    ("item", "fragments"),
    [
        ("optimizer.lr=-0.1", ["optimizer.lr:", "> 0", "-0.1"]),
        ("optimizer.lr=0", ["optimizer.lr:", "> 0"]),
        ("optimizer.momentum=1.0", ["optimizer.momentum:", "[0, 1)"]),
        ("data.batch_size=0", ["data.batch_size:", ">= 1", "0"]),
        ("data.val_fraction=1.5", ["data.val_fraction:", "(0, 1)", "1.5"]),
        ("data.val_fraction=0", ["data.val_fraction:", "(0, 1)"]),
        ("train.steps=-1", ["train.steps:", ">= 0"]),
        ("train.accumulate_steps=0", ["train.accumulate_steps:", ">= 1"]),
        ("exchange.bucket_mb=0", ["exchange.bucket_mb:", "> 0"]),
        ("checkpoint.keep=0", ["checkpoint.keep:", ">= 1"]),
        ("checkpoint.every=-5", ["checkpoint.every:", ">= 0"]),
        ("runtime.timeout_s=0", ["runtime.timeout_s:", "> 0"]),
    ],
)
def test_out_of_range_names_key_and_bound(item, fragments):
    message = config_error(overrides=[item])
    assert message.startswith(fragments[0])
    for fragment in fragments[1:]:
        assert fragment in message


def test_no_steps_and_no_epochs():
    message = config_error(overrides=["train.epochs=0"])
    assert message.startswith("train.steps:") and "train.epochs" in message


def test_unknown_strategy_lists_known():
    message = config_error(overrides=["exchange.strategy=nope"])
    assert message.startswith("exchange.strategy:")
    assert "'nope'" in message
    assert "known:" in message and "allreduce" in message.split("known:", 1)[1]


def test_unknown_optimizer_lists_known():
    message = config_error(overrides=["optimizer.name=rmsprop"])
    assert message.startswith("optimizer.name:")
    assert "'rmsprop'" in message
    known = message.split("known: ", 1)[1].split(", ")
    assert {"sgd", "adam", "adamw"} <= set(known)


def test_unknown_literal_choice_lists_allowed():
    message = config_error(overrides=["runtime.backend=mpi"])
    assert message.startswith("runtime.backend:")
    assert "'auto', 'gloo', 'nccl'" in message


def test_unknown_data_source_lists_known():
    message = config_error(overrides=["data.source=imagenet"])
    assert message.startswith("data.source:") and "digits" in message


# -- errors: model ------------------------------------------------------------------------------


def test_unknown_layer_type_lists_known():
    message = data_error({"model": {"layers": [{"type": "relu"}, {"type": "conv3d"}]}})
    assert message.startswith("model.layers[1].type:")
    assert "'conv3d'" in message
    known = message.split("known: ", 1)[1].split(", ")
    assert known == LAYERS.names()


def test_unknown_layer_argument_names_its_path():
    layer = {"type": "linear", "in_features": 2, "out_features": 3, "foo": 1}
    message = data_error({"model": {"layers": [layer]}})
    assert message.startswith("model.layers[0].foo: unknown argument")
    assert "in_features, out_features, bias" in message


def test_layer_without_type():
    message = data_error({"model": {"layers": [{"in_features": 2}]}})
    assert message.startswith("model.layers[0].type:") and "missing" in message


def test_layer_missing_required_argument():
    message = data_error({"model": {"layers": [{"type": "linear", "in_features": 2}]}})
    assert message.startswith("model.layers[0]:") and "out_features" in message


def test_layer_that_is_not_a_table():
    message = data_error({"model": {"layers": ["linear"]}})
    assert message.startswith("model.layers[0]: expected a table")


def test_unknown_model_name_lists_known():
    message = data_error({"model": {"name": "resnet"}})
    assert message.startswith("model.name:") and "digits_cnn" in message and "mlp" in message


def test_model_name_and_layers_together():
    message = data_error({"model": {"name": "mlp", "layers": [{"type": "relu"}]}})
    assert message.startswith("model.name:") and "exactly one" in message


def test_unknown_model_option_names_its_path():
    message = data_error({"model": {"name": "mlp", "options": {"width": 3}}})
    assert message.startswith("model.options.width: unknown argument")
    assert "hidden" in message


# -- errors: files and --set syntax ---------------------------------------------------------------


def test_missing_config_file(tmp_path):
    path = tmp_path / "missing.toml"
    message = config_error(path)
    assert "not found" in message and str(path) in message


def test_invalid_toml_names_file_and_position(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[train\nsteps = 1\n")
    message = config_error(path)
    assert message.startswith(f"{path}: invalid TOML")
    assert "line 1" in message


def test_non_utf8_file_is_a_config_error_naming_the_file(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"[train]\nrun_dir = '\xff'\n")
    message = config_error(path)
    assert str(path) in message


@pytest.mark.parametrize("item", ["train", "=3", "train.steps", "steps=3", " =1"])
def test_bad_set_syntax(item):
    message = config_error(overrides=[item])
    assert message.startswith(f"--set {item!r}")
    assert "section.key=value" in message


def test_set_through_a_non_table():
    message = config_error(overrides=["train.run_dir=x", "train.run_dir.y=1"])
    assert "run_dir is not a table" in message


# -- registry ------------------------------------------------------------------------------------


def test_registry_unknown_name_lists_known_sorted():
    registry: Registry[int] = Registry("widget")
    registry.register("b")(int)
    registry.register("a")(int)
    assert registry.get("a") is int
    assert "a" in registry and "c" not in registry
    assert list(registry) == registry.names() == ["a", "b"]
    with pytest.raises(ConfigError, match=r"^unknown widget 'c'; known: a, b$"):
        registry.get("c")


def test_registry_refuses_duplicates():
    registry: Registry[int] = Registry("widget")
    registry.register("a")(int)
    with pytest.raises(AssertionError):
        registry.register("a")(float)
