"""Building blocks shared by the Criteo models: feature preprocessing, MLPs, the loss head.

Plain PyTorch plus `deeprec.ops`; nothing here knows about training or optimization.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from deeprec import ops

CRITEO_DENSE = tuple(f"I{i}" for i in range(1, 14))
CRITEO_SPARSE = tuple(f"C{i}" for i in range(1, 27))


def bucket_sizes(hash_buckets: int | Sequence[int], names: Sequence[str] = CRITEO_SPARSE) -> tuple[int, ...]:
    """One bucket count per categorical feature (an int applies to all)."""
    if isinstance(hash_buckets, int):
        return (hash_buckets,) * len(names)
    sizes = tuple(int(n) for n in hash_buckets)
    if len(sizes) != len(names):
        raise ValueError(f"hash_buckets has {len(sizes)} entries for {len(names)} categorical features")
    return sizes


def dense_features(batch: dict) -> torch.Tensor:
    """Criteo counts -> [B, 13]: missing as 0, then log(1 + max(x, 0))."""
    return torch.stack([ops.log_normalize(ops.fill_missing(batch[name], 0.0)) for name in CRITEO_DENSE], dim=1)


def sparse_ids(batch: dict, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Each raw categorical column hashed into its bucket range: 26 x [B] int64."""
    return [ops.string_to_hash_bucket(batch[name], n) for name, n in zip(CRITEO_SPARSE, sizes)]


def make_embeddings(sizes: Sequence[int], dim: int, sparse: bool) -> nn.ModuleList:
    tables = nn.ModuleList(nn.Embedding(n, dim, sparse=sparse) for n in sizes)
    for table in tables:
        nn.init.uniform_(table.weight, -0.05, 0.05)
    return tables


class MLP(nn.Sequential):
    """Linear + ReLU (+ optional BatchNorm) per hidden size; `out` adds a final linear layer."""

    def __init__(self, in_dim: int, hidden: Sequence[int], out: int | None = None, batch_norm: bool = False):
        layers: list[nn.Module] = []
        for width in hidden:
            layers += [nn.Linear(in_dim, width), nn.ReLU()]
            if batch_norm:
                layers.append(nn.BatchNorm1d(width))
            in_dim = width
        if out is not None:
            layers.append(nn.Linear(in_dim, out))
        super().__init__(*layers)


def click_head(logits: torch.Tensor, batch: dict) -> dict:
    """Mean binary cross-entropy against `batch["label"]`; logits of shape [B]."""
    loss = F.binary_cross_entropy_with_logits(logits, batch["label"])
    return {"loss": loss, "logits": logits}
