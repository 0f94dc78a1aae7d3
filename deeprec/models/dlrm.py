"""DLRM (Naumov et al. 2019) with DeepRec modelzoo sizes.

    raw batch -> dense: fill, log -> bottom MLP 512-256-64-16 --+
              -> 26 x hash -> embeddings (dim 16) ---------------+-> pairwise dots -> top MLP 512-256 -> logit
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deeprec.models.common import (MLP, bucket_sizes, categorical_ids, click_head, dense_features, embed,
                                   make_sparse_layer)


@dataclass
class DLRMConfig:
    embedding_dim: int = 16
    hash_buckets: int | tuple[int, ...] = 10000  # per feature, as DeepRec's modelzoo
    bottom_mlp: tuple[int, ...] = (512, 256, 64, 16)
    top_mlp: tuple[int, ...] = (512, 256)
    batch_norm: bool = False
    embedding: str = "table"  # table | variable (EmbeddingVariable, no buckets) | torch (nn.Embedding)
    sparse_grad: bool = True  # embedding="torch": nn.Embedding(sparse=True)

    def __post_init__(self):
        if self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(f"bottom_mlp must end at embedding_dim={self.embedding_dim} for the dot "
                             f"interaction, got {self.bottom_mlp}")


class DLRM(nn.Module):
    def __init__(self, config: DLRMConfig | None = None, **overrides):
        super().__init__()
        self.config = config = config or DLRMConfig(**overrides)
        self.sizes = bucket_sizes(config.hash_buckets)
        self.embeddings = make_sparse_layer(config.embedding, self.sizes, config.embedding_dim, config.sparse_grad)
        self.bottom = MLP(13, config.bottom_mlp, batch_norm=config.batch_norm)
        n = len(self.sizes) + 1
        rows, cols = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)
        self.top = MLP(config.embedding_dim + n * (n - 1) // 2, config.top_mlp, out=1)

    def forward(self, batch: dict) -> dict:
        dense = self.bottom(dense_features(batch))
        ids = categorical_ids(batch, self.config.embedding, self.sizes)
        vectors = torch.cat([dense.unsqueeze(1), embed(self.embeddings, ids)], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pair_rows, self.pair_cols]
        logits = self.top(torch.cat([dense, dots], dim=1)).squeeze(1)
        return click_head(logits, batch)
