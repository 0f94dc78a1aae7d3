"""Wide & Deep (Cheng et al. 2016) with DeepRec modelzoo sizes.

    wide: per-id weights of the 26 categorical features + per-bucket weights of
          the bucketized dense features
    deep: DNN 1024-512-256 over [embeddings (dim 16), dense]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deeprec import ops
from deeprec.models.common import (MLP, bucket_sizes, categorical_ids, click_head, dense_features, embed,
                                   make_sparse_layer)

# log1p-scale boundaries for the wide part's dense buckets
DENSE_BOUNDARIES = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0)


@dataclass
class WDLConfig:
    embedding_dim: int = 16
    hash_buckets: int | tuple[int, ...] = 10000
    dnn: tuple[int, ...] = (1024, 512, 256)
    dense_boundaries: tuple[float, ...] = DENSE_BOUNDARIES
    embedding: str = "table"  # table | variable | torch
    sparse_grad: bool = True


class WDL(nn.Module):
    def __init__(self, config: WDLConfig | None = None, **overrides):
        super().__init__()
        self.config = config = config or WDLConfig(**overrides)
        self.sizes = bucket_sizes(config.hash_buckets)
        self.embeddings = make_sparse_layer(config.embedding, self.sizes, config.embedding_dim, config.sparse_grad)
        self.wide_sparse = make_sparse_layer(config.embedding, self.sizes, 1, config.sparse_grad)
        self.n_dense_buckets = len(config.dense_boundaries) + 1
        self.wide_dense = nn.Embedding(13 * self.n_dense_buckets, 1)
        nn.init.zeros_(self.wide_dense.weight)
        self.register_buffer("dense_offsets", torch.arange(13) * self.n_dense_buckets, persistent=False)
        self.dnn = MLP(13 + len(self.sizes) * config.embedding_dim, config.dnn, out=1)

    def forward(self, batch: dict) -> dict:
        dense = dense_features(batch)
        ids = categorical_ids(batch, self.config.embedding, self.sizes)
        buckets = ops.bucketize(dense, self.config.dense_boundaries) + self.dense_offsets
        wide = self.wide_dense(buckets).sum(dim=(1, 2))
        wide = wide + embed(self.wide_sparse, ids).sum(dim=(1, 2))
        vectors = torch.cat([embed(self.embeddings, ids).flatten(1), dense], dim=1)
        deep = self.dnn(vectors).squeeze(1)
        return click_head(wide + deep, batch)
