"""Modules registered under several names: one EmbeddingVariable shared by two features.

    self.evs = nn.ModuleDict({"C1": ev, "C2": ev})     one module, two names: evs.C1 and evs.C2

torch lists such a module once in `named_modules()` (under its first name) but saves it under
every name in `state_dict()`. Whatever swaps modules (freezing for serving, tiers, the PS and
collective runtimes) must swap every reference, or the other names keep the old module; whatever
writes a state by module path must write every path, or loading misses the other names.
"""
from __future__ import annotations


from torch import nn


def module_paths(model: nn.Module) -> dict[int, list[str]]:
    """id(module) -> every path it is registered under, in `named_modules` order."""
    paths: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(name)
    return paths


def replace_module(model: nn.Module, old: nn.Module, new: nn.Module) -> int:
    """Put `new` wherever `old` is registered among `model`'s submodules; returns how many places."""
    replaced = 0
    for parent in model.modules():
        for key, child in list(parent._modules.items()):
            if child is old:
                parent._modules[key] = new
                replaced += 1
    return replaced


def state_under_every_name(model: nn.Module, state: dict) -> dict:
    """`state` with the entries of each module registered under several names written under every
    one of them, from a name `state` holds it under (a PS job's checkpoint names it once). Names
    it holds it under several times must hold equal values (else a ValueError naming them)."""
    import torch

    out = dict(state)
    for paths in module_paths(model).values():
        if len(paths) < 2 or not all(paths):  # the root has one name
            continue
        entries = {p: {k[len(p) + 1:]: v for k, v in state.items() if k.startswith(p + ".")} for p in paths}
        held = [p for p in paths if entries[p]]
        if not held:
            continue
        source = entries[held[0]]
        for other in held[1:]:
            for k, v in entries[other].items():
                mine = source.get(k)
                if isinstance(v, torch.Tensor) and isinstance(mine, torch.Tensor) and not (
                        mine.shape == v.shape and torch.equal(mine, v)):
                    raise ValueError(f"{held[0]} and {other} are one module, but the state holds different "
                                     f"{k!r} under the two names")
        for other in paths:
            if other not in held:
                out.update({f"{other}.{k}": v for k, v in source.items()})
    return out


def state_once(model: nn.Module, state: dict) -> dict:
    """`state` (a `model.state_dict()`) without the entries under a module's other names: a module
    registered under several names is saved once, under its first (state_under_every_name gives
    the other names back when it is loaded)."""
    others = tuple(p + "." for paths in module_paths(model).values() if len(paths) > 1 and all(paths)
                   for p in paths[1:])
    return {k: v for k, v in state.items() if not k.startswith(others)} if others else state


__all__ = ["module_paths", "replace_module", "state_once", "state_under_every_name"]
