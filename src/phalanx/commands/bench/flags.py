"""A bench's flags from its config dataclass: one ``--field-name`` per field, its type and
default from the field, its help from the field's doc (``phalanx.fields.option``), and the
config back from the parsed arguments. No bench keeps a second copy of its fields."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar, cast

from phalanx.bench import Bench, Config
from phalanx.errors import ConfigError

C = TypeVar("C")
B = TypeVar("B", bound=Config)
SCALARS = (int, float, str)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _kind(hint: Any) -> tuple[str, type] | None:
    """("scalar", T), ("list", T) for ``tuple[T, ...]``, ("optional", T) for ``T | None``,
    ("bool", bool); None for what a flag cannot carry (dicts, nested specs)."""
    if hint is bool:
        return "bool", bool
    if hint in SCALARS:
        return "scalar", hint
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in SCALARS:
        return "list", args[0]
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and rest[0] in SCALARS:
            return "optional", rest[0]
    return None


def add_config_flags(p: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of dataclass ``cls`` (except ``skip`` and fields no flag can carry),
    then ``--json`` and ``--debug``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = _kind(hints[f.name])
        if f.name in skip or kind is None:
            continue
        # from the field, not from cls(): a config checks its defaults' files when built
        default: Any = (
            f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        )
        doc = f.metadata.get("doc", "")
        if kind[0] == "bool":
            # a field that is on by default is turned off by --no-NAME, and the reverse
            name = f"--no-{f.name.replace('_', '-')}" if default else _flag(f.name)
            p.add_argument(name, dest=f.name, action="store_false" if default else "store_true",
                           help=doc)  # fmt: skip
            continue
        shown = ",".join(map(str, default)) if kind[0] == "list" else default
        text = f"{doc} (default {shown})" if shown not in ("", None) else doc
        text = text if doc else f"default {shown}"
        if kind[0] == "list":
            p.add_argument(_flag(f.name), default=shown, action=_Repeated,
                           help=f"comma list, or the flag repeated; {text}")  # fmt: skip
        else:
            p.add_argument(_flag(f.name), type=kind[1], default=default, help=text)
    p.add_argument("--json", metavar="PATH", help="write every number (per round too) here")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="tracebacks")


class _Repeated(argparse.Action):
    """A list flag given more than once adds to itself (``--config a --config b`` is
    ``--config a,b``); given once, it replaces the default."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        seen: set[str] = getattr(namespace, "_repeated_seen", set())
        before = getattr(namespace, self.dest)
        setattr(namespace, self.dest, f"{before},{values}" if self.dest in seen else values)
        namespace._repeated_seen = seen | {self.dest}


def config_from_flags(cls: type[C], args: argparse.Namespace, **given: Any) -> C:
    """``cls`` from the parsed flags (comma lists become tuples); ``given`` values win."""
    hints, values = typing.get_type_hints(cls), dict(given)
    for f in dataclasses.fields(cast(Any, cls)):  # cls is a dataclass (the caller's config)
        kind = _kind(hints[f.name])
        if f.name in values or kind is None or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if kind[0] == "list":
            value = tuple(_parse(kind[1], item.strip(), f.name) for item in value.split(",")
                          if item.strip())  # fmt: skip
        values[f.name] = value
    return cls(**values)


def config_from_args(bench: Bench[B], args: argparse.Namespace) -> B:
    """``bench``'s config from its parsed flags, its own flags' values (``from_flags``) too."""
    return config_from_flags(bench.config, args, **bench.from_flags(args))


def _parse(kind: type, text: str, name: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{_flag(name)}: {text!r} is not a {kind.__name__}") from None
