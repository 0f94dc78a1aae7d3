"""Which model to train: a zoo name, or your own class or function.

    dlrm | deepfm | wdl | din | dien | dssm | mmoe      the zoo (deeprec.models), a shortcut
    my_pkg.my_module:MyModel                           importable (on sys.path or installed)
    path/to/my_model.py:MyModel                        a file, imported by its path

The attribute is a class or a function returning an `nn.Module`. It is called with
`schema=` (the data's `deeprec.data.Schema`) when it takes that argument, with no
arguments otherwise, plus the `[model_overrides]` of a config file as keywords.

The model contract (docs/models.md): `forward(raw batch) -> {"loss": scalar tensor,
"logits": [B] (one task) or [B, T] (T tasks, in the order of the schema's labels)}`.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys

import torch
from torch import nn

from deeprec.errors import ConfigError

SPEC_HELP = ("a zoo model ({zoo}), or your own: pkg.module:Class or path/to/file.py:Class "
             "(a class or function, called with schema= when it takes it)")


def is_zoo(spec: str) -> bool:
    from deeprec.models import MODELS

    return spec in MODELS


def canonical(spec: str) -> str:
    """The spec as a checkpoint records it: a file's absolute path (it must be found again from
    another working folder), anything else as given."""
    path, attr = _split(spec)
    if path is not None and path.endswith(".py"):
        return f"{os.path.abspath(path)}:{attr}"
    return spec


def same_model(a: str, b: str) -> bool:
    return canonical(a) == canonical(b)


def _split(spec: str) -> tuple[str | None, str | None]:
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"model must be a name or module:attribute, got {spec!r}")
    if ":" not in spec or spec.endswith(":"):
        return None, None
    where, attr = spec.rsplit(":", 1)
    return where, attr


def resolve(spec: str):
    """The class or function that `spec` names."""
    from deeprec.models import MODELS

    if spec in MODELS:
        return MODELS[spec][0]
    where, attr = _split(spec)
    if where is None:
        raise ConfigError(f"model {spec!r} is neither a zoo model ({', '.join(sorted(MODELS))}) nor "
                          "module:attribute; give e.g. --model my_pkg.models:MyModel or --model my_model.py:MyModel")
    if where.endswith(".py") or os.sep in where:
        module = _import_file(where, spec)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise ConfigError(f"model {spec!r}: cannot import {where!r}: {err} (is it on PYTHONPATH? a file is "
                              "given as path/to/file.py:Class)") from None
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            names = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise ConfigError(f"model {spec!r}: {where} has no attribute {attr!r}; it defines: "
                              f"{', '.join(names) or 'nothing callable'}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"model {spec!r}: {attr} is a {type(target).__name__}, not a class or function")
    return target


def _import_file(path: str, spec: str):
    if not os.path.isfile(path):
        raise ConfigError(f"model {spec!r}: no file {path!r} (from {os.getcwd()})")
    path = os.path.abspath(path)
    name = "deeprec_user_model_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    folder = os.path.dirname(path)
    sys.path.insert(0, folder)  # the file may import its neighbours
    try:
        loader_spec.loader.exec_module(module)
    except Exception:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(folder)
    return module


def _takes(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def load_model(spec: str, schema=None, **overrides) -> nn.Module:
    """Build the model `spec` names over `schema`; `overrides`: the zoo config's fields, or a custom
    model's keyword arguments."""
    from deeprec.models import build_model

    if is_zoo(spec):
        return build_model(spec, schema=schema, **overrides)
    factory = resolve(spec)
    kwargs = dict(overrides)
    if _takes(factory, "schema"):
        kwargs["schema"] = schema
    unknown = [k for k in overrides if not _takes(factory, k)]
    if unknown:
        raise ConfigError(f"model {spec!r} takes no argument {', '.join(map(repr, unknown))} "
                          "(from [model_overrides] or --embedding, which apply to zoo models or to your model's "
                          "own arguments)")
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model {spec!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def check_outputs(out, spec: str) -> None:
    """The model contract, checked on the first step so a wrong return type fails clearly."""
    if not isinstance(out, dict) or "loss" not in out or "logits" not in out:
        got = sorted(out) if isinstance(out, dict) else type(out).__name__
        raise ConfigError(f"model {spec!r}: forward(batch) must return a dict with 'loss' (a scalar tensor) and "
                          f"'logits' ([B] or [B, tasks]), got {got}")
    if not (isinstance(out["loss"], torch.Tensor) and out["loss"].dim() == 0):
        raise ConfigError(f"model {spec!r}: out['loss'] must be a scalar tensor")
    if not (isinstance(out["logits"], torch.Tensor) and out["logits"].dim() in (1, 2)):
        raise ConfigError(f"model {spec!r}: out['logits'] must be a tensor [B] or [B, tasks]")


__all__ = ["load_model", "resolve", "canonical", "same_model", "is_zoo", "check_outputs", "SPEC_HELP"]
