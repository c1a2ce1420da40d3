"""Helpers that every component's ``Config`` dataclass uses: documented fields and checks."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import MISSING, field
from typing import Any, Literal, TypeVar, Union, cast

from phalanx.errors import ConfigError

C = TypeVar("C")


class ConfigValueError(ConfigError):
    """A bad value in one field; the loader prefixes the section to ``key``."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


def option(default: Any = MISSING, doc: str = "", *, factory: Any = MISSING) -> Any:
    """A dataclass field with a docstring kept in its metadata (shown by docs and errors)."""
    if factory is not MISSING:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def require(condition: bool, key: str, reason: str) -> None:
    """Raise ConfigValueError(key, reason) unless ``condition`` holds."""
    if not condition:
        raise ConfigValueError(key, reason)


def require_choice(value: object, key: str, choices: list[str] | tuple[str, ...]) -> None:
    """Raise unless ``value`` is one of ``choices`` (the message lists them)."""
    if value not in choices:
        raise ConfigValueError(key, f"got {value!r}; allowed: {', '.join(map(str, choices))}")


def from_dict(cls: type, data: Any, path: str) -> Any:
    """Build dataclass ``cls`` from a TOML table, checking keys and types at ``path``."""
    where = path or "config"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a table, got {_type_name(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = join_key(path, unknown[0])
        raise ConfigError(f"{key}: unknown key; allowed: {', '.join(sorted(fields))}")
    kwargs = {
        name: convert(hints[name], value, join_key(path, name)) for name, value in data.items()
    }
    try:
        return cls(**kwargs)
    except ConfigValueError as e:
        raise ConfigError(f"{join_key(path, e.key)}: {e.reason}") from None


def convert(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(cast(type, hint), value, key)  # a dataclass type, never an instance
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{key}: got {value!r}; allowed: {', '.join(map(repr, allowed))}")
        return value
    if origin in (Union, types.UnionType):
        errors = []
        for option_hint in typing.get_args(hint):
            try:
                return convert(option_hint, value, key)
            except ConfigError as e:
                errors.append(str(e).split(": ", 1)[1])
        raise ConfigError(f"{key}: {'; or '.join(errors)}")
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {_type_name(value)}")
        (item_hint, *_) = typing.get_args(hint) or (Any,)
        items = [convert(item_hint, v, f"{key}[{i}]") for i, v in enumerate(value)]
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
    names: dict[type, str] = {dict: "table", list: "list", str: "string"}
    return names.get(type(value), type(value).__name__)


def with_options(config: C, options: dict[str, Any]) -> C:
    """``config`` with ``options`` replaced, type-checked as TOML values and validated again."""
    if not options:
        return config
    hints = typing.get_type_hints(type(config))
    names = {f.name for f in dataclasses.fields(config) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(options) - names)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown option; allowed: {', '.join(sorted(names))}")
    checked = {key: convert(hints[key], value, key) for key, value in options.items()}
    return dataclasses.replace(config, **checked)  # type: ignore[type-var]


def join_key(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
