"""DeepFM (Guo et al. 2017) with DeepRec modelzoo sizes.

    logit = first order (per-id weights + linear on dense)
          + FM second order over the 26 embeddings
          + DNN 1024-256-32 over [embeddings, dense]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deeprec.models.common import MLP, bucket_sizes, click_head, dense_features, make_embeddings, sparse_ids


@dataclass
class DeepFMConfig:
    embedding_dim: int = 16
    hash_buckets: int | tuple[int, ...] = 10000
    dnn: tuple[int, ...] = (1024, 256, 32)
    sparse_grad: bool = True


class DeepFM(nn.Module):
    def __init__(self, config: DeepFMConfig | None = None, **overrides):
        super().__init__()
        self.config = config = config or DeepFMConfig(**overrides)
        self.sizes = bucket_sizes(config.hash_buckets)
        self.embeddings = make_embeddings(self.sizes, config.embedding_dim, config.sparse_grad)
        self.first_order = make_embeddings(self.sizes, 1, config.sparse_grad)
        self.dense_linear = nn.Linear(13, 1)
        self.dnn = MLP(13 + len(self.sizes) * config.embedding_dim, config.dnn, out=1)

    def forward(self, batch: dict) -> dict:
        dense = dense_features(batch)
        ids = sparse_ids(batch, self.sizes)
        vectors = torch.stack([table(i) for table, i in zip(self.embeddings, ids)], dim=1)  # [B, F, D]
        linear = self.dense_linear(dense).squeeze(1) + sum(t(i).squeeze(1) for t, i in zip(self.first_order, ids))
        # FM: 0.5 * ((sum_f v_f)^2 - sum_f v_f^2), summed over the embedding dim
        fm = 0.5 * (vectors.sum(dim=1).pow(2) - vectors.pow(2).sum(dim=1)).sum(dim=1)
        deep = self.dnn(torch.cat([vectors.flatten(1), dense], dim=1)).squeeze(1)
        return click_head(linear + fm + deep, batch)
