"""`--device cpu|cuda|auto`: where the model, its tables and its batches live.

    model   dense layers, their optimizer state              -> the device
    tables  fixed tables (values + row-sparse slots)         -> the device while they fit in
                                                                DEVICE_MEMORY_SHARE of its memory (a rank
                                                                counts its 1/N share), largest first;
                                                                the rest stay on the host
            EmbeddingVariables (hash tables, they grow)      -> the host; their rows travel to the
                                                                device after the lookup (and gradients back)
    batches SmartStage: the stage runs on CPU, one packed pinned copy on a side stream
            (Config.stage_subgraph_on_cpu); without it each batch is pinned and copied here

A lookup whose tables stay on the host moves its unique ids there and its rows to the device
(deeprec.nn.collection.FusedLookup); `.to()` is differentiable, so gradients come back to the
tables' device and the row-sparse optimizer updates them where they live.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from deeprec.errors import ConfigError
from deeprec.nn.lookup import EmbeddingLookup, embedding_lookups

DEVICES = ("cpu", "cuda", "auto")
DEVICE_MEMORY_SHARE = 0.8  # of the device's memory, for the tables: the rest for activations


def resolve_device(name: str) -> torch.device:
    """cpu, cuda (this process's GPU: LOCAL_RANK under torchrun) or auto (cuda if present)."""
    if name not in DEVICES:
        raise ConfigError(f"device={name!r} is not allowed; choose one of {', '.join(DEVICES)}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device='cuda' but torch sees no CUDA device (torch.cuda.is_available() is False): "
                          "use --device cpu or auto")
    index = int(os.environ.get("LOCAL_RANK", "0") or 0) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _lookups(model: nn.Module) -> dict[str, EmbeddingLookup]:
    """The embedding lookups whose tables live in this process (not on parameter servers)."""
    return {name: m for name, m in embedding_lookups(model) if m.holds_tables}


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def move_dense(model: nn.Module, device: torch.device) -> None:
    """Every parameter and buffer outside the embedding lookups to `device`."""
    inside = {id(sub) for m in _lookups(model).values() for sub in m.modules()}
    for module in model.modules():
        if id(module) not in inside:
            module._apply(lambda t: t.to(device), recurse=False)


def place_tables(model: nn.Module, device: torch.device) -> list[str]:
    """Move each lookup's fixed tables (with their optimizer slots: attach the optimizer first) to
    `device` while they fit, largest first; returns the lookups kept on the host (by module name),
    EmbeddingVariables' included. The budget is the device's total memory, not its free memory, so
    every rank of a collective job decides alike."""
    if device.type == "cpu":
        return []
    lookups = _lookups(model)
    host = {n for n, m in lookups.items() if m.hash_tables}  # EmbeddingVariables: host hash tables
    size = {n: m.table_nbytes() for n, m in lookups.items()}
    dense = _bytes(model.parameters()) - sum(_bytes(m.parameters()) for m in lookups.values())
    budget = DEVICE_MEMORY_SHARE * torch.cuda.get_device_properties(device).total_memory - dense
    for name in sorted((n for n in lookups if n not in host), key=lambda n: (-size[n], n)):
        if size[name] <= budget:
            budget -= size[name]
            lookups[name].to(device)
        else:
            host.add(name)
    return sorted(host)


def place_model(model: nn.Module, device: torch.device) -> list[str]:
    """move_dense, then place_tables: the lookups kept on the host."""
    move_dense(model, device)
    return place_tables(model, device)


def to_device(batch, device: torch.device):
    """A batch (dict of tensors or Ragged) on `device`: pinned, then copied without blocking."""
    if device.type == "cpu":
        return batch
    moved = {}
    for key, value in batch.items():
        if hasattr(value, "pin_memory") and hasattr(value, "to"):
            value = value.pin_memory().to(device, non_blocking=True)
        moved[key] = value
    return moved


class DeviceBatches:
    """A reader whose batches arrive on `device` (without SmartStage); position as the reader's."""

    def __init__(self, reader, device: torch.device):
        self.reader, self.device = reader, device

    def __iter__(self):
        for batch in self.reader:
            yield to_device(batch, self.device)

    def state_dict(self) -> dict:
        return self.reader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.reader.load_state_dict(state)

    def __getattr__(self, name):  # stats, fingerprint, ...: the reader's
        return getattr(self.reader, name)
