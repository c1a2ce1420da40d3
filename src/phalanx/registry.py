"""A typed name -> factory registry. Unknown names list the known ones."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from phalanx.errors import ConfigError
from phalanx.fields import ConfigValueError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to factories of ``T`` (classes or functions).

    Code outside a registry never branches on a registered name: it looks the name up here.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator: ``@REGISTRY.register("name")`` on a class or factory function."""

        def decorate(factory: Callable[..., T]) -> Callable[..., T]:
            assert name not in self._entries, f"{self.kind} {name!r} registered twice"
            self._entries[name] = factory
            return factory

        return decorate

    def get(self, name: str) -> Callable[..., T]:
        """The factory registered as ``name``; ConfigError listing the known names otherwise."""
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(
                f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._entries))}"
            ) from None

    def require_known(
        self, name: object, key: str, noun: str = "", extra: Sequence[str] = ()
    ) -> None:
        """ConfigValueError at config ``key`` unless ``name`` is registered or in ``extra``."""
        known = [*extra, *self.names()]
        if name not in known:
            reason = f"unknown {noun or self.kind} {name!r}; known: {', '.join(known)}"
            raise ConfigValueError(key, reason)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))
