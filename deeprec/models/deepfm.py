"""DeepFM (Guo et al. 2017) with DeepRec modelzoo sizes, over any schema (default: Criteo's).

    logit = first order (per-id weights + linear on dense)
          + FM second order over the categorical embeddings
          + DNN 1024-256-32 over [embeddings, dense]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deeprec.data.schema import Schema
from deeprec.models.common import MLP
from deeprec.models.features import FeatureEmbedder, binary_head, label_columns, masked_mean


@dataclass
class DeepFMConfig:
    embedding_dim: int = 16
    hash_buckets: int | tuple[int, ...] = 10000
    dnn: tuple[int, ...] = (1024, 256, 32)
    embedding: str = "variable"  # variable (EmbeddingVariable, no buckets) | table | torch
    sparse_grad: bool = True
    label: str | None = None


class DeepFM(nn.Module):
    def __init__(self, config: DeepFMConfig | None = None, schema: Schema | None = None, **overrides):
        super().__init__()
        from deeprec.data.presets import CRITEO_SCHEMA

        self.config = config = config or DeepFMConfig(**overrides)
        self.schema = schema or CRITEO_SCHEMA
        self.label_columns = label_columns(self.schema, config.label)
        layer = dict(hash_buckets=config.hash_buckets, embedding=config.embedding, sparse_grad=config.sparse_grad)
        self.embeddings = FeatureEmbedder(self.schema, config.embedding_dim, **layer)
        self.first_order = FeatureEmbedder(self.schema, 1, **layer)  # per-id weights
        n_dense = len(self.embeddings.dense)
        self.dense_linear = nn.Linear(n_dense, 1) if n_dense else None
        n_vectors = len(self.embeddings.categorical) + len(self.embeddings.sequences)
        self.dnn = MLP(n_dense + n_vectors * config.embedding_dim, config.dnn, out=1)

    def forward(self, batch: dict) -> dict:
        ids = self.embeddings.ids(batch)  # hashed once for both layers
        vectors, sequences = self.embeddings.embed(ids)
        weights, weight_sequences = self.first_order.embed(ids)
        if sequences:  # a sequence is one more field: the mean of its items
            masks = {name: ids[name] >= 0 for name in sequences}
            vectors = torch.cat([vectors] + [masked_mean(v, masks[n]).unsqueeze(1) for n, v in sequences.items()], 1)
            weights = torch.cat([weights] + [masked_mean(v, masks[n]).unsqueeze(1)
                                             for n, v in weight_sequences.items()], 1)
        linear = weights.sum(dim=(1, 2))
        dense = self.embeddings.dense_values(batch)
        if dense is not None:
            linear = self.dense_linear(dense).squeeze(1) + linear
        # FM: 0.5 * ((sum_f v_f)^2 - sum_f v_f^2), summed over the embedding dim
        fm = 0.5 * (vectors.sum(dim=1).pow(2) - vectors.pow(2).sum(dim=1)).sum(dim=1)
        deep_in = [vectors.flatten(1)] + ([dense] if dense is not None else [])
        deep = self.dnn(torch.cat(deep_in, dim=1)).squeeze(1)
        return binary_head(linear + fm + deep, batch, self.label_columns[0])
