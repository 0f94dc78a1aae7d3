"""DLRM (Naumov et al. 2019) with DeepRec modelzoo sizes, over any schema (default: Criteo's).

    raw batch -> dense columns: fill, log -> bottom MLP 512-256-64-16 --+
              -> categorical columns -> embeddings (dim 16) ------------+-> pairwise dots -> top MLP 512-256 -> logit
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deeprec.data.schema import Schema
from deeprec.models.common import MLP
from deeprec.models.features import FeatureEmbedder, binary_head, label_columns, masked_mean
from deeprec.ops.step import dot_interaction


@dataclass
class DLRMConfig:
    embedding_dim: int = 16
    hash_buckets: int | tuple[int, ...] = 10000  # per categorical column, as DeepRec's modelzoo
    bottom_mlp: tuple[int, ...] = (512, 256, 64, 16)
    top_mlp: tuple[int, ...] = (512, 256)
    batch_norm: bool = False
    embedding: str = "variable"  # variable (EmbeddingVariable, no buckets) | table (hashed) | torch (nn.Embedding)
    sparse_grad: bool = True  # embedding="torch": nn.Embedding(sparse=True)
    label: str | None = None  # default: the schema's first label

    def __post_init__(self):
        if self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(f"bottom_mlp must end at embedding_dim={self.embedding_dim} for the dot "
                             f"interaction, got {self.bottom_mlp}")


class DLRM(nn.Module):
    def __init__(self, config: DLRMConfig | None = None, schema: Schema | None = None, **overrides):
        super().__init__()
        from deeprec.data.presets import CRITEO_SCHEMA

        self.config = config = config or DLRMConfig(**overrides)
        self.schema = schema or CRITEO_SCHEMA
        self.label_columns = label_columns(self.schema, config.label)
        self.embeddings = FeatureEmbedder(self.schema, config.embedding_dim, config.hash_buckets,
                                          embedding=config.embedding, sparse_grad=config.sparse_grad)
        n_dense = len(self.embeddings.dense)
        self.bottom = MLP(n_dense, config.bottom_mlp, batch_norm=config.batch_norm) if n_dense else None
        n = len(self.embeddings.categorical) + len(self.embeddings.sequences) + (1 if n_dense else 0)
        width = (config.embedding_dim if n_dense else 0) + n * (n - 1) // 2
        self.top = MLP(width, config.top_mlp, out=1)

    def forward(self, batch: dict) -> dict:
        e = self.embeddings(batch)
        vectors = [e.categorical] + [masked_mean(e.sequences[s], e.masks[s]).unsqueeze(1) for s in e.sequences]
        dense = [] if self.bottom is None else [self.bottom(e.dense)]
        vectors = torch.cat([d.unsqueeze(1) for d in dense] + vectors, dim=1)
        dots = dot_interaction(vectors)  # the pairs i > j of bmm(vectors, vectors^T), in one native op
        logits = self.top(torch.cat([*dense, dots], dim=1)).squeeze(1)
        return binary_head(logits, batch, self.label_columns[0])

