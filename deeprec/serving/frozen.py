"""An EmbeddingVariable frozen for serving: a sorted key index and a value table.

    keys ──searchsorted(sorted keys + sentinel)──> position ──hit?──> values[position]
                                                              └miss──> the variable's default_value_no_permission
                                                                       (what evaluation reads for an unseen key)

Plain tensor ops, so torch.export captures the lookup; no hash table, no lock, no insert. The
graph holds no count of keys (the sentinel, int64 max with the missing value as its row, ends
every search), so an online update may replace the buffers with more keys (`merged`).
"""
from __future__ import annotations

import torch
from torch import nn

_SENTINEL = torch.iinfo(torch.int64).max  # keeps the index non-empty; never a hit (see lookup)


class FrozenEmbeddingVariable(nn.Module):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, missing_value: float):
        super().__init__()
        sorted_keys, table = sorted_index(keys, values, float(missing_value))
        self.register_buffer("sorted_keys", sorted_keys)
        self.register_buffer("values", table)
        self.register_buffer("missing_value", torch.tensor(float(missing_value)))
        self.embedding_dim = values.shape[1]

    @classmethod
    def from_variable(cls, ev) -> "FrozenEmbeddingVariable":
        keys, values = ev.snapshot()  # the rows as evaluation reads them now (checkpoint state untouched)
        return cls(keys, values, ev._no_permission)

    def gather(self, keys: torch.Tensor) -> torch.Tensor:
        keys = keys.to(torch.int64)
        position = torch.searchsorted(self.sorted_keys, keys)  # <= the sentinel's index: every key <= int64 max
        hit = self.sorted_keys[position] == keys  # the sentinel's own row holds the missing value
        return torch.where(hit.unsqueeze(1), self.values[position], self.missing_value)

    def lookup(self, keys: torch.Tensor, counts=None, train: bool = False):
        """EmbeddingVariable.lookup's (rows, values, generation), for an EmbeddingCollection in eval."""
        return None, self.gather(keys), None

    def forward(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids)
        return self.gather(ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)


def sorted_index(keys: torch.Tensor, values: torch.Tensor, missing_value: float):
    """(sorted keys + sentinel, their rows + the missing value's row)."""
    order = torch.argsort(keys)
    fill = torch.full((1, values.shape[1]), missing_value)
    return (torch.cat([keys[order].to(torch.int64), torch.tensor([_SENTINEL])]),
            torch.cat([values[order].float(), fill]))


def merged(sorted_keys: torch.Tensor, table: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           missing_value: float):
    """A frozen index with `keys` set to `values` (new keys added, known ones overwritten)."""
    old_keys, old_values = sorted_keys[:-1], table[:-1]
    known = torch.isin(old_keys, keys)
    return sorted_index(torch.cat([old_keys[~known], keys.to(torch.int64)]),
                        torch.cat([old_values[~known], values.float()]), missing_value)


def freeze_variables(model: nn.Module) -> int:
    """Replace every EmbeddingVariable of `model` (in place) by its frozen form; returns how many."""
    from deeprec.nn.variable import EmbeddingVariable

    found = [(name, m) for name, m in model.named_modules() if isinstance(m, EmbeddingVariable)]
    for name, ev in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FrozenEmbeddingVariable.from_variable(ev))  # a ModuleList's children too
    return len(found)
