"""Layers shared by the models: the MLP. Plain PyTorch; nothing here knows about training."""
from __future__ import annotations

from typing import Sequence

from torch import nn


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
