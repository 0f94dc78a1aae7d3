"""One feature layer for every model: a dataset schema in, embeddings out.

    categorical column  -> hashed id (table) or 63-bit key (variable) -------+
    sequence column     -> ids, last max_length, padded with -1 ------------+-> one EmbeddingCollection
                           (embed_with: shares that column's table)           |   (fused lookup)
    dense column        -> log(1 + max(x, 0)), missing as 0 -> [B, N]         |
                                                                              v
        Embedded(categorical [B, C, D], sequences {name: [B, L, D]}, masks {name: [B, L]}, dense [B, N])

embedding = "variable" EmbeddingVariables keyed by the 63-bit hash (the default: no buckets, no
                       collisions; what the PS serves; as fast as a table, bench/e2e.py)
            "table"    fixed hashed tables (hash_buckets rows each), fused lookup, row-sparse update
            "torch"    one nn.Embedding per table (the plain-PyTorch baseline)

Plain PyTorch plus `deeprec.ops` and `deeprec.nn`; nothing here knows about training.
"""
from __future__ import annotations

import functools
import re
from typing import Mapping, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from deeprec import ops
from deeprec.data.schema import Schema
from deeprec.errors import ConfigError, check_choice

EMBEDDINGS = ("table", "variable", "torch")
INIT_BOUND = 0.05


class Embedded(NamedTuple):
    categorical: torch.Tensor  # [B, C, D], columns in FeatureEmbedder.categorical order
    sequences: dict  # name -> [B, L, D], zero at padding
    masks: dict  # name -> [B, L] bool, True on real items
    dense: torch.Tensor | None  # [B, N], FeatureEmbedder.dense order; None without dense columns


def _key(name: str) -> str:
    return re.sub(r"\W", "_", name)


class FeatureEmbedder(nn.Module):
    def __init__(self, schema: Schema, dim: int, hash_buckets: int | Sequence[int] | Mapping[str, int] = 100_000,
                 max_length: int = 50, embedding: str = "variable", sparse_grad: bool = True):
        super().__init__()
        check_choice("embedding", embedding, EMBEDDINGS)
        self.schema, self.dim, self.max_length, self.kind = schema, dim, max_length, embedding
        self.categorical = schema.of_kind("categorical")
        self.sequences = schema.of_kind("sequence")
        self.dense = schema.of_kind("dense")
        self.position = {name: i for i, name in enumerate(self.categorical)}
        self.buckets = self._bucket_sizes(hash_buckets)
        self.table_of = {name: schema[name].embed_with or name for name in (*self.categorical, *self.sequences)}
        self._string_columns = [n for n in self.categorical if schema[n].dtype == "string"]
        if embedding == "torch":
            self.collection = None
            self.tables = nn.ModuleDict()
            for name in (*self.categorical, *self.sequences):
                if self.table_of[name] == name:
                    table = nn.Embedding(self.buckets[name], dim, sparse=sparse_grad)
                    nn.init.uniform_(table.weight, -INIT_BOUND, INIT_BOUND)
                    self.tables[_key(name)] = table
        else:
            from deeprec.nn import EmbeddingCollection, EmbeddingFeature, EmbeddingVariableOption, InitializerOption

            dynamic = embedding == "variable"
            option = EmbeddingVariableOption(InitializerOption(
                functools.partial(nn.init.uniform_, a=-INIT_BOUND, b=INIT_BOUND))) if dynamic else None
            features = [EmbeddingFeature(name, None if dynamic else self.buckets[name], ev_option=option,
                                         table=schema[name].embed_with, pooled=name not in self.sequences)
                        for name in (*self.categorical, *self.sequences)]
            self.collection = EmbeddingCollection(features, dim, init_bound=INIT_BOUND)

    def _bucket_sizes(self, hash_buckets) -> dict[str, int]:
        """Buckets per column: an int for all, one per categorical column in order, or {column: n}
        (missing names get the default 100k); a sequence that embeds with a column takes its size."""
        names = (*self.categorical, *self.sequences)
        if isinstance(hash_buckets, int):
            sizes = dict.fromkeys(names, hash_buckets)
        elif isinstance(hash_buckets, Mapping):
            unknown = sorted(set(hash_buckets) - set(names))
            if unknown:
                raise ConfigError(f"hash_buckets names {', '.join(unknown)}: not categorical or sequence columns "
                                  f"of the {self.schema.name} schema")
            sizes = {n: int(hash_buckets.get(n, 100_000)) for n in names}
        else:
            given = tuple(int(n) for n in hash_buckets)
            if len(given) != len(self.categorical):
                raise ConfigError(f"hash_buckets has {len(given)} entries for {len(self.categorical)} categorical "
                                  f"columns of the {self.schema.name} schema")
            sizes = {**dict.fromkeys(self.sequences, 100_000), **dict(zip(self.categorical, given))}
        for name in self.sequences:
            shared = self.schema[name].embed_with
            if shared is not None:
                sizes[name] = sizes[shared]
        return sizes

    def length(self, name: str) -> int:
        """The model's max_length, or the column's if that is shorter."""
        return min(self.schema[name].max_length or self.max_length, self.max_length)

    # -- ids ----------------------------------------------------------------------------------
    def ids(self, batch: dict) -> dict[str, torch.Tensor]:
        """Categorical columns -> [B] ids; sequences -> [B, L] ids, -1 at padding.
        Bucket ids in [0, n) for tables, 63-bit keys for variables (negative = missing)."""
        keyed = self.kind == "variable"
        out = {}
        if self._string_columns:  # one native call hashes every string column
            columns = [batch[n] for n in self._string_columns]
            hashed = (ops.string_to_hash_key(columns) if keyed else
                      ops.string_to_hash_bucket(columns, [self.buckets[n] for n in self._string_columns]))
            out.update({name: hashed[i] for i, name in enumerate(self._string_columns)})
        for name in self.categorical:
            if name not in out:  # dtype int
                out[name] = batch[name] if keyed else ops.id_to_bucket(batch[name], self.buckets[name])
        for name in self.sequences:
            ragged = ops.ragged_keys(batch[name]) if keyed else ops.hash_ragged(batch[name], self.buckets[name])
            out[name] = ops.pad_ragged(ragged, self.length(name), -1)[0]
        return {name: out[name] for name in (*self.categorical, *self.sequences)}

    # -- embeddings ----------------------------------------------------------------------------
    def embed(self, ids: dict) -> tuple[torch.Tensor, dict]:
        """(categorical [B, C, D], {sequence: [B, L, D]}) for the ids of `ids()`."""
        if self.collection is not None:
            out = self.collection(ids)
            return out if self.sequences else (out, {})
        tables = {name: self.tables[_key(self.table_of[name])] for name in ids}
        categorical = torch.stack([tables[n](ids[n]) for n in self.categorical], dim=1)
        sequences = {}
        for name in self.sequences:
            vectors = tables[name](ids[name].clamp_min(0))
            sequences[name] = vectors * (ids[name] >= 0).unsqueeze(-1).to(vectors.dtype)
        return categorical, sequences

    def dense_values(self, batch: dict) -> torch.Tensor | None:
        if not self.dense:
            return None
        # elementwise over all the columns at once: 3 ops a batch, not 3 per column
        return ops.log_normalize(ops.fill_missing(torch.stack([batch[n] for n in self.dense], dim=1), 0.0))

    def forward(self, batch: dict) -> Embedded:
        ids = self.ids(batch)
        categorical, sequences = self.embed(ids)
        masks = {name: ids[name] >= 0 for name in self.sequences}
        return Embedded(categorical, sequences, masks, self.dense_values(batch))

    # -- views the models use --------------------------------------------------------------------
    def columns(self, kind: str, role: str | None = None) -> list[str]:
        return [c.name for c in self.schema.columns if c.kind == kind and (role is None or c.role == role)]

    def column(self, embedded: Embedded, name: str) -> torch.Tensor:
        """[B, D] of one categorical column."""
        return embedded.categorical[:, self.position[name]]

    def flat_width(self, categorical, sequences, dense) -> int:
        return (len(categorical) + len(sequences)) * self.dim + len(dense)

    def flat(self, embedded: Embedded, categorical, sequences, dense) -> torch.Tensor:
        """[B, flat_width]: the chosen categorical embeddings, mean-pooled sequences, dense values."""
        parts = [self.column(embedded, name) for name in categorical]
        parts += [masked_mean(embedded.sequences[name], embedded.masks[name]) for name in sequences]
        if dense:
            index = [self.dense.index(name) for name in dense]
            parts.append(embedded.dense if len(index) == len(self.dense) else embedded.dense[:, index])
        return torch.cat(parts, dim=1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the valid positions of [B, L, D] (zeros for an empty row)."""
    weights = mask.to(values.dtype).unsqueeze(-1)
    return (values * weights).sum(1) / weights.sum(1).clamp_min(1.0)


def label_columns(schema: Schema, label: str | None) -> tuple[str, ...]:
    if label is None:
        return schema.labels[:1]
    if label not in schema.labels:
        raise ConfigError(f"label {label!r} is not a label column of the {schema.name} schema "
                          f"({', '.join(schema.labels)})")
    return (label,)


def binary_head(logits: torch.Tensor, batch: dict, label: str) -> dict:
    """Mean binary cross-entropy of logits [B] against batch[label]."""
    return {"loss": F.binary_cross_entropy_with_logits(logits, batch[label]), "logits": logits}
