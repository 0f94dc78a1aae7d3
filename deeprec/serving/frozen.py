"""An EmbeddingVariable frozen for serving: a sorted key index and a value table.

    keys ──searchsorted(sorted keys)──> position ──hit?──> values[position]
                                                  └miss──> the variable's default_value_no_permission
                                                           (what evaluation reads for an unseen key)

Plain tensor ops, so torch.export captures the lookup; no hash table, no lock, no insert.
"""
from __future__ import annotations

import torch
from torch import nn

_SENTINEL = torch.iinfo(torch.int64).max  # keeps the index non-empty; never a hit (see lookup)


class FrozenEmbeddingVariable(nn.Module):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, missing_value: float):
        super().__init__()
        order = torch.argsort(keys)
        self.register_buffer("sorted_keys", torch.cat([keys[order], torch.tensor([_SENTINEL])]))
        self.register_buffer("values", torch.cat([values[order].float(), torch.zeros(1, values.shape[1])]))
        self.register_buffer("missing_value", torch.tensor(float(missing_value)))
        self.embedding_dim = values.shape[1]

    @classmethod
    def from_variable(cls, ev) -> "FrozenEmbeddingVariable":
        with ev._lock:  # the rows as evaluation reads them now (no eviction, checkpoint state untouched)
            keys, values = ev.keys[: ev.size].clone(), ev.weight[: ev.size].clone()
        return cls(keys, values, ev._no_permission)

    @property
    def num_keys(self) -> int:
        return self.sorted_keys.numel() - 1

    def gather(self, keys: torch.Tensor) -> torch.Tensor:
        keys = keys.to(torch.int64)
        position = torch.searchsorted(self.sorted_keys, keys).clamp(max=self.num_keys)
        hit = (self.sorted_keys[position] == keys) & (position < self.num_keys)
        return torch.where(hit.unsqueeze(1), self.values[position], self.missing_value)

    def lookup(self, keys: torch.Tensor, counts=None, train: bool = False):
        """EmbeddingVariable.lookup's (rows, values, generation), for an EmbeddingCollection in eval."""
        return None, self.gather(keys), None

    def forward(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids)
        return self.gather(ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)


def freeze_variables(model: nn.Module) -> int:
    """Replace every EmbeddingVariable of `model` (in place) by its frozen form; returns how many."""
    from deeprec.nn.variable import EmbeddingVariable

    found = [(name, m) for name, m in model.named_modules() if isinstance(m, EmbeddingVariable)]
    for name, ev in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FrozenEmbeddingVariable.from_variable(ev))  # a ModuleList's children too
    return len(found)
