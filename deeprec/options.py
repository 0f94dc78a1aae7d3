"""Options declared once, as dataclass fields: command-line flags, TOML files and
defaults all come from them.

    @dataclass
    class TrainConfig:
        steps: int | None = option(None, "total optimizer steps")
        optimize: Config = option(factory=Config)           # nested: its fields become flags too

    add_arguments(parser, TrainConfig)      # --steps, and every nested field (help, default shown)
    values = merge(load_toml("run.toml", TrainConfig), given(args))   # a file, then the flags
    cfg = build(TrainConfig, values)

A field's help is its metadata's, else the docstring under it (torchtitan's style). Its other
metadata: flag (default --field-name), choices, cli=False (no flag), file=False (no TOML key),
parse (str -> value), nargs/const (argparse), key (the flat name of a field with no flag).
Nested dataclasses (or `X | None` of one) are tables in TOML and flags named by their `prefix`
metadata; the top level's are sections, one group each in --help. A flag's name (underscores for
dashes) also works as a flat key at the top level of a TOML file or `build`'s values, so options
keep their names when they move into sections (`section_aliases`).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import tomllib
import types
import typing
from typing import Any

import msgspec

from deeprec.errors import ConfigError, regular_file

_MISSING = dataclasses.MISSING


def option(default: Any = _MISSING, help: str = "", *, factory=None, **meta) -> Any:
    """A dataclass field with its help text and CLI metadata."""
    metadata = {"help": help, **meta}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """{field: the docstring written under it} (one line each), read from the class's source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (frozen): help from metadata only
        return {}
    body, docs = tree.body[0].body, {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def flag_of(f: dataclasses.Field, prefix: str = "") -> str:
    """The field's flag: its `flag` metadata, else --<prefix><field-name>."""
    return f.metadata.get("flag") or f"--{prefix}{f.name.replace('_', '-')}"


def help_of(cls, f: dataclasses.Field) -> str:
    return f.metadata.get("help") or field_docs(cls).get(f.name) or f.name.replace("_", " ")


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
                  defaults=_MISSING, exclude: tuple[str, ...] = ()) -> None:
    """One flag per field of `cls` (recursing into nested dataclasses) but those in `exclude`;
    defaults are suppressed so that `given(args)` holds only what the user typed. `defaults`:
    the instance whose values the help shows (a parent's default), None to show none."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        meta, tp = f.metadata, hints[f.name]
        if meta.get("cli", True) is False or f.name in exclude:
            continue
        default = _default_of(f) if defaults is _MISSING else getattr(defaults, f.name, None)
        nested = _nested(tp)
        if nested is not None:
            group = parser
            if not path and isinstance(parser, argparse.ArgumentParser):  # a section: its own group in --help
                summary = (inspect.getdoc(nested) or "").split("\n")[0]
                group = parser.add_argument_group(meta.get("title", f.name), summary or None)
            add_arguments(group, nested, path + (f.name,), meta.get("prefix", prefix), default)
            continue
        flag = flag_of(f, prefix)
        shown = "" if default is None or default == [] else f" (default: {_shown(default)})"
        kwargs: dict[str, Any] = dict(dest=".".join(path + (f.name,)), default=argparse.SUPPRESS,
                                      help=help_of(cls, f) + shown)
        scalar, many = _base(tp)
        if "nargs" in meta:
            kwargs.update(nargs=meta["nargs"], const=meta.get("const"))
        elif scalar is bool and not many:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif many:
            kwargs["nargs"] = "+"
        if "action" not in kwargs:
            kwargs["type"] = _argparse_type(meta["parse"]) if "parse" in meta else (scalar if scalar in (int, float) else str)
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
                kwargs["type"] = str if "parse" in meta else kwargs["type"]
        if "action" not in kwargs and "choices" not in kwargs:
            kwargs["metavar"] = meta.get("metavar") or flag[2:].replace("-", "_").upper()
        parser.add_argument(flag, *meta.get("aliases", ()), **kwargs)


def bytes_flag(text: str) -> int:
    """argparse type of a byte count with units (parse_bytes), for flags declared outside a dataclass."""
    return _argparse_type(parse_bytes)(text)


def _argparse_type(parse):
    """`parse` for argparse: its error becomes argparse's (the flag named, exit code 2)."""
    def convert(text: str):
        try:
            return parse(text)
        except (ValueError, ConfigError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return convert


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def given(args: argparse.Namespace, cls, path: tuple[str, ...] = ()) -> dict:
    """The flags of `cls`'s fields (added under `path`) that the user gave, as a nested dict."""
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict = {}
    for dest, value in vars(args).items():
        parts = dest.split(".")
        if tuple(parts[:len(path)]) != path or len(parts) <= len(path) or parts[len(path)] not in names:
            continue
        node = out
        *parents, leaf = parts[len(path):]
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_toml(path: str, what: str = "--config") -> dict:
    """A TOML file as a dict; a missing file or bad TOML is a ConfigError naming the option (`what`)
    and the file."""
    regular_file(path, what)
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{what} {path}: not valid TOML: {err}") from None


def load_toml(path: str, cls) -> dict:
    """A TOML file whose keys are `cls`'s field names (tables for nested options), or flags'
    names at the top level."""
    values = section_aliases(cls, read_toml(path), where=path)
    check_keys(values, cls, path, ())
    return values


def flat_names(cls, path: tuple = (), prefix: str = "") -> dict[str, tuple[str, ...]]:
    """{flat name: the field's path} of every field under `cls`'s sections: a flag's name with
    underscores (--checkpoint-dir: checkpoint_dir -> ("checkpoint", "dir")), or its `key`."""
    hints, out = _hints(cls), {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        nested = _nested(hints[f.name])
        if nested is not None:
            out.update(flat_names(nested, path + (f.name,), meta.get("prefix", prefix)))
            continue
        if meta.get("key"):
            out[meta["key"]] = path + (f.name,)
        if path and meta.get("cli", True) is not False:
            flag = flag_of(f, prefix)
            out[flag[2:].replace("-", "_")] = path + (f.name,)
    return out


def section_aliases(cls, values: dict, where: str = "") -> dict:
    """`values` with every flat name at the top level moved into its section (a section's name
    with a table keeps it; `data="x.tsv"` is the flag --data, data.paths)."""
    sections = {f.name for f in dataclasses.fields(cls) if _nested(_hints(cls)[f.name]) is not None}
    names, out = flat_names(cls), {}
    for key, value in values.items():
        if key in sections and dataclasses.is_dataclass(value):
            value = _as_dict(value)  # a built section: its values, which flat names may then override
        if key in sections and isinstance(value, dict):
            out[key] = merge(out.get(key, {}), value)
            continue
        if key not in names:
            if key in sections or not sections:
                out[key] = value  # check_keys names the problem
                continue
            known = sorted(set(names) | sections)
            raise ConfigError(f"{where + ': ' if where else ''}unknown option {key!r}; sections: "
                              f"{', '.join(sorted(sections))}; or one of {', '.join(known)}")
        *parents, leaf = names[key]
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def check_keys(values: dict, cls, where: str, path: tuple = (), python: bool = False) -> None:
    """Every key of `values` names a field (tables: of the nested dataclass), or a ConfigError names
    it. `python`: values from Python, where fields that no file sets and built sections are allowed."""
    hints = _hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    settable = {n for n, f in names.items() if python or f.metadata.get("file", True) is not False}
    for key, value in values.items():
        if key not in settable:
            raise ConfigError(f"{where}: unknown option {'.'.join(path + (key,))!r}; allowed here: "
                              f"{', '.join(sorted(settable))}")
        nested = _nested(hints[key])
        if nested is None or (python and (value is None or isinstance(value, nested))):
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {'.'.join(path + (key,))} must be a table of {nested.__name__} options")
        check_keys(value, nested, where, path + (key,), python)


def build(cls, values: dict, path: tuple = (), base=None, prefix: str = ""):
    """`cls(**values)` with nested tables built into their dataclasses (over the default
    instance's values: `base`, else the field's default), string flags parsed, and every value
    checked against its declaration (`checked`)."""
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
            value = build(nested, merge(defaults, value), path + (f.name,), inner, f.metadata.get("prefix", prefix))
        elif nested is None:
            value = checked(f, tp, value, path, prefix)
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ConfigError(f"{'.'.join(path) or cls.__name__}: {err}") from None


def where_set(f: dataclasses.Field, path: tuple = (), prefix: str = "") -> str:
    """How a user names the field: its flag, and its TOML key where that differs."""
    key = ".".join(path + (f.name,))
    if f.metadata.get("cli", True) is False:
        return key
    flag = flag_of(f, prefix)
    return f"{flag} ({key} in a config file)" if path else flag


def _declared(tp, meta) -> Any:
    """The field's type for msgspec, with its declared bounds (ge, gt, le) and choices."""
    bounds = {k: meta[k] for k in ("ge", "gt", "le", "lt") if k in meta}
    if (isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union) and \
            len([a for a in typing.get_args(tp) if a is not type(None)]) > 1:
        return tp  # e.g. bool | str: msgspec checks each
    scalar, many = _base(tp)
    optional = tp is not scalar and type(None) in typing.get_args(tp)
    if bounds:
        scalar = typing.Annotated[scalar, msgspec.Meta(**bounds)]
    if many:
        return typing.get_origin(tp)[scalar] if typing.get_origin(tp) in (list, tuple) else list[scalar]
    return scalar | None if optional else scalar


def checked(f: dataclasses.Field, tp, value, path: tuple = (), prefix: str = ""):
    """`value` parsed (a string, where the field declares `parse`) and validated against the field's
    declaration (its type, bounds and choices, by msgspec): a ConfigError naming the flag otherwise."""
    meta = f.metadata
    try:
        if "parse" in meta and isinstance(value, str):
            value = meta["parse"](value)
        if _base(tp)[1] and isinstance(value, str):
            value = [value]  # one path where a list is declared
        declared = _declared(tp, meta)
    except (ValueError, ConfigError) as err:
        raise ConfigError(f"{where_set(f, path, prefix)}: {err}") from None
    if meta.get("file", True) is False:
        return value  # Python objects only (exception classes, pools): their class checks them
    if "choices" in meta and "parse" not in meta and value is not None and value not in meta["choices"]:
        raise ConfigError(f"{where_set(f, path, prefix)}: {value!r} is not allowed; choose one of "
                          f"{', '.join(map(str, meta['choices']))}")
    try:
        msgspec.convert(value, declared, strict=True)
    except msgspec.ValidationError as err:
        expected = re.sub(r", got `[^`]*`$", "", str(err).split(" - at ")[0]).replace(" | null", " or none")
        raise ConfigError(f"{where_set(f, path, prefix)}: {expected[0].lower()}{expected[1:]}, got {value!r}") \
            from None
    except TypeError:  # a type msgspec does not model: its class checks it
        pass
    return tuple(value) if typing.get_origin(tp) is tuple and isinstance(value, list) else value


def check_fields(obj, path: tuple = ()) -> None:
    """Every field of the dataclass `obj` checked against its declaration (for objects built in
    Python, whose values no flag or file parsed); parsed values are stored back."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        if _nested(hints[f.name]) is None:
            setattr(obj, f.name, checked(f, hints[f.name], getattr(obj, f.name), path))


_BYTES = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?)(b?))?b?", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """A byte count with an optional unit: 4096, 512K, 2G (binary, as ulimit), 512MiB, 1.5GB (decimal)."""
    if isinstance(text, int):
        return text
    match = _BYTES.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a byte count: give e.g. 4096, 512M, 2G, 512MiB or 1.5GB")
    number, unit, binary, b = match.groups()
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    base = 1000 if (b and not binary) else 1024  # 1.5GB: decimal; 2G, 2GiB: binary
    return int(float(number) * base ** power)


def _as_dict(value) -> dict:
    """A nested default's fields (shallow), so a table or flag overrides only what it names."""
    if value is None or not dataclasses.is_dataclass(value):
        return {}
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
