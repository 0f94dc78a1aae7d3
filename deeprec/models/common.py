"""Building blocks shared by the Criteo models: feature preprocessing, MLPs, the loss head.

Plain PyTorch plus `deeprec.ops`; nothing here knows about training or optimization.
"""
from __future__ import annotations

import functools
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
    """Each raw categorical column hashed into its bucket range: 26 x [B] int64 (one op for all)."""
    ids = ops.string_to_hash_bucket([batch[name] for name in CRITEO_SPARSE], list(sizes))
    return [ids[f] for f in range(len(CRITEO_SPARSE))]  # indexed, so a traced graph sees 26 values


EMBEDDINGS = ("table", "variable", "torch")


def make_embeddings(sizes: Sequence[int], dim: int, sparse: bool) -> nn.ModuleList:
    """One plain `nn.Embedding` per feature (the `embedding="torch"` baseline)."""
    tables = nn.ModuleList(nn.Embedding(n, dim, sparse=sparse) for n in sizes)
    for table in tables:
        nn.init.uniform_(table.weight, -0.05, 0.05)
    return tables


def make_sparse_layer(kind: str, sizes: Sequence[int], dim: int, sparse_grad: bool = True,
                      names: Sequence[str] = CRITEO_SPARSE) -> nn.Module:
    """The categorical features' embeddings:

    table     EmbeddingCollection over fixed hashed tables (fused lookup, row-sparse update)
    variable  EmbeddingCollection over EmbeddingVariables keyed by the 63-bit hash (no buckets)
    torch     one nn.Embedding per feature (plain PyTorch)
    """
    from deeprec.errors import check_choice
    from deeprec.nn import EmbeddingCollection, EmbeddingFeature, EmbeddingVariableOption, InitializerOption

    check_choice("embedding", kind, EMBEDDINGS)
    if kind == "torch":
        return make_embeddings(sizes, dim, sparse_grad)
    dynamic = kind == "variable"
    option = EmbeddingVariableOption(InitializerOption(functools.partial(nn.init.uniform_, a=-0.05, b=0.05)))
    features = [EmbeddingFeature(name, None, ev_option=option) if dynamic else EmbeddingFeature(name, n)
                for name, n in zip(names, sizes)]
    return EmbeddingCollection(features, dim)


def categorical_ids(batch: dict, kind: str, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Hashed ids per feature: bucket ids for tables, 63-bit keys for variables."""
    if kind == "variable":
        keys = ops.string_to_hash_key([batch[name] for name in CRITEO_SPARSE])
        return [keys[f] for f in range(len(CRITEO_SPARSE))]
    return sparse_ids(batch, sizes)


def embed(layer: nn.Module, ids: list[torch.Tensor]) -> torch.Tensor:
    """[B, F, D] embeddings of the features' ids, whichever layer kind."""
    if isinstance(layer, nn.ModuleList):
        return torch.stack([table(i) for table, i in zip(layer, ids)], dim=1)
    return layer(ids)


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
