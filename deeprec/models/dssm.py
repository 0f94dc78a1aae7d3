"""DSSM two-tower retrieval model: user and item towers, cosine (or dot) similarity.

    user tower: [user categoricals, mean of user-side sequences, user dense] -> MLP 256-128 -> 64
    item tower: [item categoricals, mean of item-side sequences, item dense] -> MLP 256-128 -> 64
    logit = scale * cos(u, v) + bias   (or u . v + bias)

The towers share nothing until the similarity: two independent branches of the
graph (what the MultiStream "full" policy runs side by side).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deeprec.data.schema import Schema
from deeprec.errors import ConfigError, check_choice
from deeprec.models.common import MLP
from deeprec.models.features import Embedded, FeatureEmbedder, binary_head, label_columns


@dataclass
class DSSMConfig:
    embedding_dim: int = 16
    hash_buckets: int = 100_000
    max_length: int = 50
    tower: tuple[int, ...] = (256, 128)
    output_dim: int = 64
    similarity: str = "cosine"  # cosine | dot
    embedding: str = "variable"  # variable (EmbeddingVariable, no buckets) | table | torch
    label: str | None = None

    def __post_init__(self):
        check_choice("DSSMConfig.similarity", self.similarity, ("cosine", "dot"))


class Tower(nn.Module):
    def __init__(self, embedder: FeatureEmbedder, role: str, hidden, out: int):
        super().__init__()
        self.flat = embedder.flat  # the shared layer's view; its parameters belong to the DSSM once
        self.categorical = embedder.columns("categorical", role)
        self.sequences = embedder.columns("sequence", role)
        self.dense = embedder.columns("dense", role)
        self.mlp = MLP(embedder.flat_width(self.categorical, self.sequences, self.dense), hidden, out=out)

    def forward(self, embedded: Embedded) -> torch.Tensor:
        return self.mlp(self.flat(embedded, self.categorical, self.sequences, self.dense))


class DSSM(nn.Module):
    def __init__(self, config: DSSMConfig | None = None, schema: Schema | None = None, **overrides):
        super().__init__()
        from deeprec.data.presets import BEHAVIOR_SCHEMA

        self.config = config = config or DSSMConfig(**overrides)
        self.schema = schema or BEHAVIOR_SCHEMA
        self.label_columns = label_columns(self.schema, config.label)
        for role in ("user", "item"):
            if not any(c.role == role and c.kind in ("categorical", "sequence", "dense") for c in self.schema.columns):
                raise ConfigError(f"DSSM needs columns with role={role!r} in the {self.schema.name} schema")
        self.embedder = FeatureEmbedder(self.schema, config.embedding_dim, config.hash_buckets, config.max_length,
                                        embedding=config.embedding)
        self.user_tower = Tower(self.embedder, "user", config.tower, config.output_dim)
        self.item_tower = Tower(self.embedder, "item", config.tower, config.output_dim)
        self.scale = nn.Parameter(torch.tensor(5.0))
        self.bias = nn.Parameter(torch.zeros(()))

    def towers(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        embedded = self.embedder(batch)
        return self.user_tower(embedded), self.item_tower(embedded)

    def forward(self, batch: dict) -> dict:
        user, item = self.towers(batch)
        if self.config.similarity == "cosine":
            similarity = self.scale * F.cosine_similarity(user, item, dim=1)
        else:
            similarity = (user * item).sum(1)
        return binary_head(similarity + self.bias, batch, self.label_columns[0])

    def retrieval_vectors(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """User and item vectors whose dot product orders a user's items as the logit does (what
        deeprec.metrics' Recall@K / NDCG@K rank candidates with)."""
        user, item = self.towers(batch)
        if self.config.similarity == "cosine":
            return self.scale * F.normalize(user, dim=1), F.normalize(item, dim=1)
        return user, item
