"""A model written for TorchRec, trained by deeprec.

`SparseNN` is TorchRec code: its forward takes dense features and a KeyedJaggedTensor and
calls an EmbeddingBagCollection built from `EmbeddingBagConfig`s. Only its import changed:

    from torchrec import EmbeddingBagCollection                    # TorchRec
    from deeprec.interop.torchrec import EmbeddingBagCollection     # deeprec: fused lookup, EVs, PS

`ClickModel` is the deeprec side (docs/models.md): built over the data's schema, `forward`
takes the raw batch (strings, NaN), makes the KeyedJaggedTensor with `to_kjt` (hashing, run
ahead by SmartStage) and returns {"loss", "logits"}:

    deeprec train --model examples/torchrec_model.py:ClickModel --smart-stage
    deeprec launch --ps 1 --workers 2 -- train --model examples/torchrec_model.py:ClickModelEV
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from deeprec.interop.torchrec import EmbeddingBagCollection, to_kjt


class SparseNN(nn.Module):
    """TorchRec-style: dense [B, N] and a KJT in, logits [B] out."""

    def __init__(self, ebc: EmbeddingBagCollection, num_dense: int, hidden: int = 64):
        super().__init__()
        self.ebc = ebc
        self.features = [f for t in ebc.embedding_bag_configs() for f in t.feature_names]
        width = sum(t.embedding_dim * len(t.feature_names) for t in ebc.embedding_bag_configs())
        self.dense_arch = nn.Sequential(nn.Linear(num_dense, hidden), nn.ReLU())
        self.over_arch = nn.Sequential(nn.Linear(hidden + width, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        embedded = self.ebc(sparse_features)  # KeyedTensor [B, sum of dims]
        pooled = embedded.to_dict()
        sparse = torch.cat([pooled[f] for f in self.features], dim=1)
        return self.over_arch(torch.cat([self.dense_arch(dense_features), sparse], dim=1)).squeeze(1)


def tables_for(columns, dim: int, num_embeddings: int) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=f"t_{c}", embedding_dim=dim, num_embeddings=num_embeddings,
                               feature_names=[c], pooling=PoolingType.SUM) for c in columns]


class ClickModel(nn.Module):
    """The raw batch -> (dense, KJT) -> SparseNN -> click loss. Fixed tables of `num_embeddings`
    hashed ids each; `embedding_variables=True`: unbounded 63-bit keys (what a PS serves)."""

    def __init__(self, schema, dim: int = 16, num_embeddings: int = 10_000, embedding_variables: bool = False):
        super().__init__()
        self.dense, self.sparse = schema.of_kind("dense"), schema.of_kind("categorical")
        self.label = schema.labels[0]
        self.num_buckets = None if embedding_variables else num_embeddings
        ebc = EmbeddingBagCollection(tables_for(self.sparse, dim, num_embeddings),
                                     embedding_variables=embedding_variables)
        self.model = SparseNN(ebc, len(self.dense))

    def forward(self, batch):
        dense = torch.stack([batch[c] for c in self.dense], 1).nan_to_num(0.0).clamp(min=0.0).log1p()
        kjt = to_kjt(batch, self.sparse, num_buckets=self.num_buckets)
        logits = self.model(dense, kjt)
        return {"loss": F.binary_cross_entropy_with_logits(logits, batch[self.label]), "logits": logits}


class ClickModelEV(ClickModel):
    """ClickModel on EmbeddingVariables: for parameter-server jobs."""

    def __init__(self, schema, dim: int = 16):
        super().__init__(schema, dim, embedding_variables=True)
