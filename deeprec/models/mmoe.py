"""MMoE (Ma et al. 2018): shared experts, one softmax gate and one tower per task.

    x = [categorical embeddings, mean-pooled sequences, dense]
    experts_k(x) = MLP 256-128                       k = 1..num_experts
    task t: gate_t = softmax(W_t x); h_t = sum_k gate_t,k * experts_k(x); logit_t = MLP 64 -> 1
    loss = sum over tasks of BCE(logit_t, label_t)   (tasks: the schema's labels, e.g. ByteRec's finish, like)

`logits` is [B, T] in the order of `label_columns`; evaluation reports AUC per task.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deeprec.data.schema import Schema
from deeprec.models.common import MLP
from deeprec.models.features import FeatureEmbedder


@dataclass
class MMoEConfig:
    embedding_dim: int = 16
    hash_buckets: int = 100_000
    max_length: int = 50
    num_experts: int = 4
    expert: tuple[int, ...] = (256, 128)
    tower: tuple[int, ...] = (64,)
    embedding: str = "variable"  # variable (EmbeddingVariable, no buckets) | table | torch


class MMoE(nn.Module):
    def __init__(self, config: MMoEConfig | None = None, schema: Schema | None = None, **overrides):
        super().__init__()
        from deeprec.data.presets import BYTEREC_SCHEMA

        self.config = config = config or MMoEConfig(**overrides)
        self.schema = schema or BYTEREC_SCHEMA
        self.label_columns = self.schema.labels
        self.embedder = e = FeatureEmbedder(self.schema, config.embedding_dim, config.hash_buckets, config.max_length,
                                           embedding=config.embedding)
        self.categorical, self.sequences = e.columns("categorical"), e.columns("sequence")
        self.dense = e.columns("dense")
        width = e.flat_width(self.categorical, self.sequences, self.dense)
        self.experts = nn.ModuleList(MLP(width, config.expert) for _ in range(config.num_experts))
        self.gates = nn.ModuleList(nn.Linear(width, config.num_experts) for _ in self.label_columns)
        self.towers = nn.ModuleList(MLP(config.expert[-1], config.tower, out=1) for _ in self.label_columns)

    def forward(self, batch: dict) -> dict:
        x = self.embedder.flat(self.embedder(batch), self.categorical, self.sequences, self.dense)
        experts = torch.stack([expert(x) for expert in self.experts], dim=1)  # [B, K, H]
        logits = []
        for gate, tower in zip(self.gates, self.towers):
            weights = torch.softmax(gate(x), dim=1).unsqueeze(-1)
            logits.append(tower((weights * experts).sum(1)).squeeze(1))
        logits = torch.stack(logits, dim=1)  # [B, T]
        labels = torch.stack([batch[name] for name in self.label_columns], dim=1)
        losses = F.binary_cross_entropy_with_logits(logits, labels, reduction="none").mean(0)
        return {"loss": losses.sum(), "logits": logits,
                **{f"loss_{name}": losses[k].detach() for k, name in enumerate(self.label_columns)}}
