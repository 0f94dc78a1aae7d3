"""Wide & Deep (Cheng et al. 2016) with DeepRec modelzoo sizes, over any schema (default: Criteo's).

    wide: per-id weights of the categorical columns + per-bucket weights of
          the bucketized dense columns
    deep: DNN 1024-512-256 over [embeddings (dim 16), dense]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deeprec import ops
from deeprec.data.schema import Schema
from deeprec.models.common import MLP
from deeprec.models.features import FeatureEmbedder, binary_head, label_columns, masked_mean

# log1p-scale boundaries for the wide part's dense buckets
DENSE_BOUNDARIES = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0)


@dataclass
class WDLConfig:
    embedding_dim: int = 16
    hash_buckets: int | tuple[int, ...] = 10000
    dnn: tuple[int, ...] = (1024, 512, 256)
    dense_boundaries: tuple[float, ...] = DENSE_BOUNDARIES
    embedding: str = "variable"  # variable (EmbeddingVariable, no buckets) | table | torch
    sparse_grad: bool = True
    label: str | None = None


class WDL(nn.Module):
    def __init__(self, config: WDLConfig | None = None, schema: Schema | None = None, **overrides):
        super().__init__()
        from deeprec.data.presets import CRITEO_SCHEMA

        self.config = config = config or WDLConfig(**overrides)
        self.schema = schema or CRITEO_SCHEMA
        self.label_columns = label_columns(self.schema, config.label)
        layer = dict(hash_buckets=config.hash_buckets, embedding=config.embedding, sparse_grad=config.sparse_grad)
        self.embeddings = FeatureEmbedder(self.schema, config.embedding_dim, **layer)
        self.wide_sparse = FeatureEmbedder(self.schema, 1, **layer)
        n_dense = len(self.embeddings.dense)
        self.n_dense_buckets = len(config.dense_boundaries) + 1
        self.wide_dense = nn.Embedding(max(n_dense, 1) * self.n_dense_buckets, 1)
        nn.init.zeros_(self.wide_dense.weight)
        self.register_buffer("dense_offsets", torch.arange(n_dense) * self.n_dense_buckets, persistent=False)
        n_vectors = len(self.embeddings.categorical) + len(self.embeddings.sequences)
        self.dnn = MLP(n_dense + n_vectors * config.embedding_dim, config.dnn, out=1)

    def forward(self, batch: dict) -> dict:
        ids = self.embeddings.ids(batch)  # hashed once for both layers
        vectors, sequences = self.embeddings.embed(ids)
        weights, weight_sequences = self.wide_sparse.embed(ids)
        masks = {name: ids[name] >= 0 for name in sequences}
        wide = weights.sum(dim=(1, 2)) + sum(masked_mean(v, masks[n]).sum(1) for n, v in weight_sequences.items())
        deep_in = [vectors.flatten(1)] + [masked_mean(v, masks[n]) for n, v in sequences.items()]
        dense = self.embeddings.dense_values(batch)
        if dense is not None:
            buckets = ops.bucketize(dense, self.config.dense_boundaries) + self.dense_offsets
            wide = self.wide_dense(buckets).sum(dim=(1, 2)) + wide
            deep_in.append(dense)
        deep = self.dnn(torch.cat(deep_in, dim=1)).squeeze(1)
        return binary_head(wide + deep, batch, self.label_columns[0])
