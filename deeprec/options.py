"""Options declared once, as dataclass fields: command-line flags, TOML files and
defaults all come from them.

    @dataclass
    class TrainConfig:
        steps: int | None = option(None, "total optimizer steps")
        optimize: Config = option(factory=Config)           # nested: its fields become flags too

    add_arguments(parser, TrainConfig)      # --steps, and every nested field (help, default shown)
    values = merge(load_toml("run.toml", TrainConfig), given(args))   # a file, then the flags
    cfg = build(TrainConfig, values)

A field's metadata: help, flag (default --field-name), choices, cli=False (no flag),
parse (str -> value), nargs/const (argparse). Nested dataclasses (or `X | None` of one)
are tables in TOML and flags named by their `prefix` metadata.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
import types
import typing
from typing import Any

from deeprec.errors import ConfigError

_MISSING = dataclasses.MISSING


def option(default: Any = _MISSING, help: str = "", *, factory=None, **meta) -> Any:
    """A dataclass field with its help text and CLI metadata."""
    metadata = {"help": help, **meta}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _nested(tp) -> type | None:
    """The dataclass a field holds (also through `X | None`), or None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            return inner[0]
    return None


def _base(tp):
    """(scalar type, is a list) of an annotation such as `int | None` or `list[str]`."""
    if typing.get_origin(tp) in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return (args[0] if args else str), True
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base(inner[0]) if len(inner) == 1 else (str, False)
    return tp, False


def _default_of(f: dataclasses.Field):
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:
        return f.default_factory()
    return None


def add_arguments(parser: argparse.ArgumentParser, cls, path: tuple[str, ...] = (), prefix: str = "",
                  defaults=_MISSING) -> None:
    """One flag per field of `cls` (recursing into nested dataclasses); defaults are
    suppressed so that `given(args)` holds only what the user typed. `defaults`: the
    instance whose values the help shows (a parent's default), None to show none."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        meta, tp = f.metadata, hints[f.name]
        if meta.get("cli", True) is False:
            continue
        default = _default_of(f) if defaults is _MISSING else getattr(defaults, f.name, None)
        nested = _nested(tp)
        if nested is not None:
            add_arguments(parser, nested, path + (f.name,), meta.get("prefix", prefix), default)
            continue
        flag = meta.get("flag") or f"--{prefix}{f.name.replace('_', '-')}"
        shown = "" if default is None or default == [] else f" (default: {_shown(default)})"
        kwargs: dict[str, Any] = dict(dest=".".join(path + (f.name,)), default=argparse.SUPPRESS,
                                      help=(meta.get("help") or f.name.replace("_", " ")) + shown)
        scalar, many = _base(tp)
        if "nargs" in meta:
            kwargs.update(nargs=meta["nargs"], const=meta.get("const"))
        elif scalar is bool and not many:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif many:
            kwargs["nargs"] = "+"
        if "action" not in kwargs:
            kwargs["type"] = meta.get("parse") or (scalar if scalar in (int, float) else str)
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
                kwargs["type"] = str if "parse" in meta else kwargs["type"]
        if "action" not in kwargs and "choices" not in kwargs:
            kwargs["metavar"] = meta.get("metavar") or f.name.upper()
        parser.add_argument(flag, *meta.get("aliases", ()), **kwargs)


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def given(args: argparse.Namespace, cls) -> dict:
    """The flags of `cls`'s fields that the user gave, as a nested dict of values."""
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict = {}
    for dest, value in vars(args).items():
        if dest.split(".")[0] not in names:
            continue
        node = out
        *parents, leaf = dest.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_toml(path: str, what: str = "config") -> dict:
    """A TOML file as a dict; a missing file or bad TOML is a ConfigError naming the file."""
    if not os.path.exists(path):
        raise ConfigError(f"no such {what} file: {path!r}")
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML: {err}") from None


def load_toml(path: str, cls) -> dict:
    """A TOML file whose keys are `cls`'s field names (tables for nested options)."""
    values = read_toml(path)
    _check_keys(values, cls, path, ())
    return values


def _check_keys(values: dict, cls, where: str, path: tuple) -> None:
    hints = _hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in values.items():
        field = names.get(key)
        if field is None or field.metadata.get("file", True) is False:
            allowed = sorted(n for n, f in names.items() if f.metadata.get("file", True) is not False)
            raise ConfigError(f"{where}: unknown option {'.'.join(path + (key,))!r}; allowed here: "
                              f"{', '.join(allowed)}")
        nested = _nested(hints[key])
        if nested is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {'.'.join(path + (key,))} must be a table of {nested.__name__} options")
            _check_keys(value, nested, where, path + (key,))


def build(cls, values: dict, path: tuple = (), base=None):
    """`cls(**values)` with nested tables built into their dataclasses (over the default
    instance's values: `base`, else the field's default) and string flags parsed."""
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        value, tp = values[f.name], hints[f.name]
        nested = _nested(tp)
        if nested is not None and isinstance(value, dict):
            inner = getattr(base, f.name) if base is not None else _default_of(f)
            defaults = {**f.metadata.get("defaults", {}), **_as_dict(inner)}
            value = build(nested, merge(defaults, value), path + (f.name,), inner)
        elif "parse" in f.metadata and isinstance(value, str):
            value = f.metadata["parse"](value)
        elif _base(tp)[1] and isinstance(value, list) and typing.get_origin(tp) is tuple:
            value = tuple(value)
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ConfigError(f"{'.'.join(path) or cls.__name__}: {err}") from None


def _as_dict(value) -> dict:
    """A nested default's fields (shallow), so a table or flag overrides only what it names."""
    if value is None or not dataclasses.is_dataclass(value):
        return {}
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
