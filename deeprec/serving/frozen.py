"""An EmbeddingVariable frozen for serving: a sorted key index and a value table.

    keys ──searchsorted(sorted keys + sentinel)──> position ──hit?──> values[position]
                                                              └miss──> the variable's default_value_no_permission
                                                                       (what evaluation reads for an unseen key)

Plain tensor ops, so torch.export captures the lookup; no hash table, no lock, no insert. The
graph holds no count of keys (sentinels, int64 max with the missing value as their rows, end
every search), so an online update may replace the buffers with more keys (`merged`). The index
keeps headroom (a quarter more rows, at least 64, as sentinels, rounded up): a compiled program
(serving.compiled) has fixed shapes, and deltas that add keys fill the headroom without
changing them.
"""
from __future__ import annotations

import torch
from torch import nn

_SENTINEL = torch.iinfo(torch.int64).max  # keeps the index non-empty; never a hit (see lookup)


class FrozenEmbeddingVariable(nn.Module):
    native_path = False  # an EmbeddingCollection of frozen variables looks each up by its `lookup`
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, missing_value: float):
        super().__init__()
        sorted_keys, table = sorted_index(keys, values, float(missing_value), with_headroom(keys.shape[0]))
        self.register_buffer("sorted_keys", sorted_keys)
        self.register_buffer("values", table)
        self.register_buffer("missing_value", torch.tensor(float(missing_value)))
        self.embedding_dim = values.shape[1]

    @classmethod
    def from_variable(cls, ev) -> "FrozenEmbeddingVariable":
        keys, values = ev.snapshot()  # the rows as evaluation reads them now (checkpoint state untouched)
        return cls(keys, values, ev._no_permission)

    def gather(self, keys: torch.Tensor) -> torch.Tensor:
        keys = keys.to(self.sorted_keys.device, torch.int64)  # ids come from the host's preprocessing
        position = torch.searchsorted(self.sorted_keys, keys)  # <= the sentinel's index: every key <= int64 max
        hit = self.sorted_keys[position] == keys  # the sentinel's own row holds the missing value
        return torch.where(hit.unsqueeze(1), self.values[position], self.missing_value)

    def lookup(self, keys: torch.Tensor, counts=None, train: bool = False):
        """EmbeddingVariable.lookup's (rows, values, generation), for an EmbeddingCollection in eval."""
        return None, self.gather(keys), None

    def forward(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids)
        return self.gather(ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)


def with_headroom(keys: int) -> int:
    """Rows of a frozen index of `keys` keys: the keys, a quarter more (at least 64) and a sentinel,
    rounded up to one of 8 sizes per doubling. A variable that grew a little between two full exports
    then keeps its shape, and the second export takes the first one's compiled package from the
    cache (serving.compile_cache) instead of compiling again."""
    rows = keys + max(keys // 4, 64) + 1
    step = 1 << max(rows.bit_length() - 4, 0)
    return -(-rows // step) * step


def sorted_index(keys: torch.Tensor, values: torch.Tensor, missing_value: float, rows: int = 0):
    """(sorted keys + sentinels, their rows + the missing value's rows): max(rows, keys + 1) rows."""
    order = torch.argsort(keys)
    pad = max(rows - keys.shape[0], 1)
    fill = torch.full((pad, values.shape[1]), missing_value)
    return (torch.cat([keys[order].to(torch.int64), torch.full((pad,), _SENTINEL)]),
            torch.cat([values[order].float(), fill]))


def merged(sorted_keys: torch.Tensor, table: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           missing_value: float):
    """A frozen index with `keys` set to `values` (new keys added, known ones overwritten); as many
    rows as before while the keys fit (a compiled program keeps its shapes), else grown with headroom."""
    real = sorted_keys != _SENTINEL
    old_keys, old_values = sorted_keys[real], table[real]
    known = torch.isin(old_keys, keys)
    all_keys = torch.cat([old_keys[~known], keys.to(torch.int64)])
    rows = sorted_keys.shape[0] if all_keys.shape[0] < sorted_keys.shape[0] else with_headroom(all_keys.shape[0])
    return sorted_index(all_keys, torch.cat([old_values[~known], values.float()]), missing_value, rows)


def freeze_variables(model: nn.Module) -> int:
    """Replace every EmbeddingVariable of `model` (in place) by its frozen form; returns how many.
    One registered under several names (shared by two features) becomes one frozen module, under
    every name."""
    from deeprec.nn.shared import replace_module
    from deeprec.nn.variable import EmbeddingVariable

    found = {id(m): m for _, m in model.named_modules(remove_duplicate=False) if isinstance(m, EmbeddingVariable)}
    for ev in found.values():
        replace_module(model, ev, FrozenEmbeddingVariable.from_variable(ev))  # a ModuleList's children too
    return len(found)


def shared_names(model: nn.Module, tensors: dict) -> tuple[dict, dict]:
    """An export's weights with each tensor once, and what `tie_shared` needs to undo that: a module
    registered under several names (an EmbeddingVariable shared by two features) is one module of
    the traced program, whose graph reads it by one of its names; safetensors stores a tensor once.
    Returns (tensors, {"modules": {other name: first name}, "tensors": {other name: kept name}})."""
    from deeprec.nn.shared import module_paths

    kept, aliases, first = {}, {}, {}
    for name, t in tensors.items():
        identity = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and identity in first:
            aliases[name] = first[identity]
        else:
            first.setdefault(identity, name)
            kept[name] = t
    modules = {other: paths[0] for paths in module_paths(model).values() if len(paths) > 1 and paths[0]
               for other in paths[1:]}
    return kept, {"modules": modules, "tensors": aliases}


def tie_shared(module: nn.Module, shared: dict, tensors: dict) -> dict:
    """A loaded export's module with its shared modules one module again (an online update of one
    name reaches every name), and `tensors` (its weights as stored) with every name filled in."""
    for other, name in sorted(shared.get("modules", {}).items(), key=lambda item: item[0].count(".")):
        parent, _, child = other.rpartition(".")
        owner = module.get_submodule(parent) if parent else module
        owner._modules[child] = module.get_submodule(name)
    return {**tensors, **{other: tensors[name] for other, name in shared.get("tensors", {}).items()
                         if name in tensors}}
