"""A model of your own, trained by the whole engine:

    deeprec train --model examples/custom_model.py:ClickModel --smart-stage --checkpoint-dir runs/click
    deeprec export --checkpoint runs/click --out exports/click && deeprec serve exports/click

The contract (docs/models.md): built with `schema=` (the data's columns) when it takes that
argument; `forward(raw batch) -> {"loss": scalar, "logits": [B] (or [B, tasks])}`.
"""
import torch
from torch import nn

import deeprec as dr


class ClickModel(nn.Module):
    def __init__(self, schema, dim: int = 16):
        super().__init__()
        self.dense_names = schema.of_kind("dense")
        self.sparse_names = schema.of_kind("categorical")
        self.label = schema.labels[0]
        self.embeddings = nn.ModuleDict({c: dr.EmbeddingVariable(dim, name=c) for c in self.sparse_names})
        width = len(self.dense_names) + dim * len(self.sparse_names)
        self.mlp = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, batch):
        dense = torch.stack([batch[c] for c in self.dense_names], dim=1)
        dense = torch.log1p(torch.nan_to_num(dense, nan=0.0).clamp(min=0.0))
        keys = dr.ops.string_to_hash_key([batch[c] for c in self.sparse_names])
        embedded = [self.embeddings[c](k) for c, k in zip(self.sparse_names, keys)]
        logits = self.mlp(torch.cat([dense, *embedded], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch[self.label])
        return {"loss": loss, "logits": logits}
