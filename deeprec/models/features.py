"""Schema-driven feature inputs for the behaviour models (DIN, DIEN, DSSM, MMoE).

    categorical column  -> hashed id -> [B, D]
    sequence column     -> hashed ids, last max_length, padded -> [B, L, D] and mask [B, L]
                           (a sequence with embed_with shares that column's table: DIN's history items)
    dense column        -> log(1 + max(x, 0)), missing as 0 -> [B]

Plain PyTorch plus `deeprec.ops`; nothing here knows about training.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from deeprec import ops
from deeprec.data.schema import Schema


def _key(name: str) -> str:
    return re.sub(r"\W", "_", name)


class FeatureEmbedder(nn.Module):
    def __init__(self, schema: Schema, dim: int, hash_buckets: int, max_length: int = 50):
        super().__init__()
        self.schema, self.dim, self.buckets, self.max_length = schema, dim, hash_buckets, max_length
        self.tables = nn.ModuleDict()
        self._table_of: dict[str, str] = {}
        for c in schema.columns:
            if c.kind == "categorical" or (c.kind == "sequence" and c.embed_with is None):
                table = nn.Embedding(hash_buckets, dim, sparse=True)
                nn.init.uniform_(table.weight, -0.05, 0.05)
                self.tables[_key(c.name)] = table
                self._table_of[c.name] = _key(c.name)
        for c in schema.columns:
            if c.kind == "sequence" and c.embed_with is not None:
                self._table_of[c.name] = _key(c.embed_with)

    def columns(self, kind: str, role: str | None = None) -> list[str]:
        return [c.name for c in self.schema.columns if c.kind == kind and (role is None or c.role == role)]

    def ids(self, batch: dict, name: str) -> torch.Tensor:
        column = self.schema[name]
        if column.dtype == "int":
            return ops.id_to_bucket(batch[name], self.buckets)
        return ops.string_to_hash_bucket(batch[name], self.buckets)

    def categorical(self, batch: dict, name: str) -> torch.Tensor:
        return self.tables[self._table_of[name]](self.ids(batch, name))

    def length(self, name: str) -> int:
        """The model's max_length, or the column's if that is shorter."""
        return min(self.schema[name].max_length or self.max_length, self.max_length)

    def sequence(self, batch: dict, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        length = self.length(name)
        ids, mask = ops.pad_ragged(ops.hash_ragged(batch[name], self.buckets), length)
        return self.tables[self._table_of[name]](ids), mask

    def dense(self, batch: dict, name: str) -> torch.Tensor:
        return ops.log_normalize(ops.fill_missing(batch[name], 0.0))

    def flat_width(self, categorical, sequences, dense) -> int:
        return (len(categorical) + len(sequences)) * self.dim + len(dense)

    def flat(self, batch: dict, categorical, sequences, dense) -> torch.Tensor:
        """[B, flat_width]: categorical embeddings, mean-pooled sequences, then dense values."""
        parts = [self.categorical(batch, name) for name in categorical]
        parts += [masked_mean(*self.sequence(batch, name)) for name in sequences]
        if dense:
            parts.append(torch.stack([self.dense(batch, name) for name in dense], dim=1))
        return torch.cat(parts, dim=1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the valid positions of [B, L, D] (zeros for an empty row)."""
    weights = mask.to(values.dtype).unsqueeze(-1)
    return (values * weights).sum(1) / weights.sum(1).clamp_min(1.0)


def label_columns(schema: Schema, label: str | None) -> tuple[str, ...]:
    if label is None:
        return schema.labels[:1]
    if label not in schema.labels:
        from deeprec.errors import ConfigError

        raise ConfigError(f"label {label!r} is not a label column of the {schema.name} schema "
                          f"({', '.join(schema.labels)})")
    return (label,)


def binary_head(logits: torch.Tensor, batch: dict, label: str) -> dict:
    """Mean binary cross-entropy of logits [B] against batch[label]."""
    return {"loss": F.binary_cross_entropy_with_logits(logits, batch[label]), "logits": logits}
