"""DeepFM (Guo et al. 2017) with DeepRec modelzoo sizes.

    logit = first order (per-id weights + linear on dense)
          + FM second order over the 26 embeddings
          + DNN 1024-256-32 over [embeddings, dense]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deeprec.models.common import (MLP, bucket_sizes, categorical_ids, click_head, dense_features, embed,
                                   make_sparse_layer)


@dataclass
class DeepFMConfig:
    embedding_dim: int = 16
    hash_buckets: int | tuple[int, ...] = 10000
    dnn: tuple[int, ...] = (1024, 256, 32)
    embedding: str = "table"  # table | variable | torch
    sparse_grad: bool = True


class DeepFM(nn.Module):
    def __init__(self, config: DeepFMConfig | None = None, **overrides):
        super().__init__()
        self.config = config = config or DeepFMConfig(**overrides)
        self.sizes = bucket_sizes(config.hash_buckets)
        self.embeddings = make_sparse_layer(config.embedding, self.sizes, config.embedding_dim, config.sparse_grad)
        self.first_order = make_sparse_layer(config.embedding, self.sizes, 1, config.sparse_grad)
        self.dense_linear = nn.Linear(13, 1)
        self.dnn = MLP(13 + len(self.sizes) * config.embedding_dim, config.dnn, out=1)

    def forward(self, batch: dict) -> dict:
        dense = dense_features(batch)
        ids = categorical_ids(batch, self.config.embedding, self.sizes)
        vectors = embed(self.embeddings, ids)  # [B, F, D]
        linear = self.dense_linear(dense).squeeze(1) + embed(self.first_order, ids).sum(dim=(1, 2))
        # FM: 0.5 * ((sum_f v_f)^2 - sum_f v_f^2), summed over the embedding dim
        fm = 0.5 * (vectors.sum(dim=1).pow(2) - vectors.pow(2).sum(dim=1)).sum(dim=1)
        deep = self.dnn(torch.cat([vectors.flatten(1), dense], dim=1)).squeeze(1)
        return click_head(linear + fm + deep, batch)
