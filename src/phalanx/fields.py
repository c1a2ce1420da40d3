"""Helpers that every component's ``Config`` dataclass uses: documented fields and checks."""

from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any

from phalanx.errors import ConfigError


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
