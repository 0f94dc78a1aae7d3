"""`collate`: merge raw batches (or single rows) into one, for `torch.utils.data.DataLoader`.

    DataLoader(reader, batch_size=None, num_workers=1)               # reader batches as they are
    DataLoader(reader, batch_size=4, collate_fn=dr.data.collate)     # 4 reader batches -> one
    DataLoader(rows, batch_size=512, collate_fn=dr.data.collate)     # map-style rows -> a batch

Tensors are concatenated along dim 0 (0-dim tensors and Python numbers stacked),
Raggeds concatenated row-wise, `bytes`/`str` values become a string Ragged, lists of
ints or strings a sequence Ragged: the same batch format the readers yield.
"""
from __future__ import annotations

import numbers
from typing import Sequence

import torch

from deeprec.errors import ConfigError
from deeprec.ragged import Ragged


def _merge(name: str, values: list):
    first = values[0]
    if isinstance(first, Ragged):
        return Ragged.cat(values)
    if isinstance(first, torch.Tensor):
        return torch.stack(values) if first.dim() == 0 else torch.cat(values)
    if isinstance(first, (bytes, str)):
        return Ragged.from_strings(values)
    if isinstance(first, (list, tuple)):
        return Ragged.from_lists(values)
    if isinstance(first, numbers.Number):
        return torch.tensor(values, dtype=torch.float32 if isinstance(first, float) else torch.long)
    raise ConfigError(f"collate: column {name!r} holds {type(first).__name__}; batches hold tensors, "
                      "deeprec.Ragged, bytes/str, numbers or lists")


def collate(items: Sequence[dict]) -> dict:
    """One batch from raw batches or rows (dicts with the same keys)."""
    if not items:
        raise ConfigError("collate needs at least one batch")
    keys = list(items[0])
    for i, item in enumerate(items[1:], 1):
        if list(item) != keys:
            raise ConfigError(f"collate: item {i} has columns {sorted(item)}, item 0 has {sorted(keys)}")
    return {k: _merge(k, [item[k] for item in items]) for k in keys}


__all__ = ["collate"]


def batch_rows(batch) -> int:
    """Rows of a raw batch (a dict or tuple of tensors and Raggeds): its first batched value's."""
    for value in (batch.values() if isinstance(batch, dict) else batch):
        if isinstance(value, Ragged):
            return len(value.offsets) - 1
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            return int(value.shape[0])
    raise ConfigError("cannot split the batch: it holds no tensor or array with a batch dimension")
