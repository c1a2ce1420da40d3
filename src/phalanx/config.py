"""RunConfig: the nested per-component Config dataclasses of one run; TOML loading; overrides.

Each component owns its ``Config`` (validated in ``__post_init__``); this module only assembles
them, converts TOML tables into them with type checks, and applies ``--set section.key=value``.
Every error is a one-line ConfigError naming the key path and what is allowed.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

from phalanx.checkpoint import CheckpointConfig
from phalanx.data.sources import DataConfig
from phalanx.errors import ConfigError
from phalanx.exchange.base import ExchangeConfig
from phalanx.fields import ConfigValueError, option
from phalanx.models.layers import ModelConfig
from phalanx.optim.factory import OptimizerConfig
from phalanx.runtime.context import RuntimeConfig
from phalanx.trainer import TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib


@dataclass(kw_only=True)
class RunConfig:
    """Everything one `phalanx train` run needs, one table per component."""

    model: ModelConfig = option(
        factory=lambda: ModelConfig(name="digits_cnn"), doc="the network ([model])"
    )
    data: DataConfig = option(factory=DataConfig, doc="the training data ([data])")
    train: TrainConfig = option(factory=TrainConfig, doc="the loop ([train])")
    optimizer: OptimizerConfig = option(factory=OptimizerConfig, doc="the optimizer")
    exchange: ExchangeConfig = option(factory=ExchangeConfig, doc="gradient exchange ([exchange])")
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig, doc="checkpoints")
    runtime: RuntimeConfig = option(factory=RuntimeConfig, doc="process group and devices")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a TOML file (or start from defaults) and apply ``section.key=value`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_toml(Path(path))
    return config_from_data(data, overrides)


def config_from_data(data: dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    """A RunConfig from already-parsed tables (e.g. a run directory's config.json)."""
    data = copy.deepcopy(data)
    for item in overrides or []:
        _apply_override(data, item)
    return from_dict(RunConfig, data, "")


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None


def _apply_override(data: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    parts = key.strip().split(".")
    if len(parts) < 2:
        raise ConfigError(f"--set {item!r}: expected section.key=value (e.g. train.lr=0.1)")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word is a string: --set exchange.strategy=tree
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {part} is not a table")
        node = child
    node[parts[-1]] = value


def from_dict(cls: type, data: Any, path: str) -> Any:
    """Build dataclass ``cls`` from a TOML table, checking keys and types at ``path``."""
    where = path or "config"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a table, got {_type_name(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = _join(path, unknown[0])
        raise ConfigError(f"{key}: unknown key; allowed: {', '.join(sorted(fields))}")
    kwargs = {name: _convert(hints[name], value, _join(path, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigValueError as e:
        raise ConfigError(f"{_join(path, e.key)}: {e.reason}") from None


def _convert(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, key)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{key}: got {value!r}; allowed: {', '.join(map(repr, allowed))}")
        return value
    if origin in (Union, types.UnionType):
        errors = []
        for option_hint in typing.get_args(hint):
            try:
                return _convert(option_hint, value, key)
            except ConfigError as e:
                errors.append(str(e).split(": ", 1)[1])
        raise ConfigError(f"{key}: {'; or '.join(errors)}")
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {_type_name(value)}")
        (item_hint, *_) = typing.get_args(hint) or (Any,)
        items = [_convert(item_hint, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {_type_name(value)}")
        return value
    return _convert_scalar(hint, value, key)


def _convert_scalar(hint: Any, value: Any, key: str) -> Any:
    if hint is Any:
        return value
    if hint is type(None):
        if value is not None:
            raise ConfigError(f"{key}: expected nothing, got {_type_name(value)}")
        return None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool) or not isinstance(value, hint):
        raise ConfigError(f"{key}: expected {hint.__name__}, got {_type_name(value)} {value!r}")
    return value


def _type_name(value: Any) -> str:
    return {dict: "table", list: "list", str: "string"}.get(type(value), type(value).__name__)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def describe(config: Any = None, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key path, type, default, doc) of every config key, for docs and help text."""
    config = RunConfig() if config is None else config
    rows = []
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        key = _join(prefix, f.name)
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            rows.extend(describe(value, key))
            continue
        hint = hints[f.name]
        type_name = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
        rows.append((key, type_name, repr(value), f.metadata.get("doc", "")))
    return rows
