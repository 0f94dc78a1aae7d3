"""DIEN (Zhou et al. 2019): interest extraction (GRU) and interest evolution (AUGRU).

    keys [B, L, E] --GRU--> interests h_t                     (interest extractor)
    auxiliary loss: h_t must tell the next clicked item e_t+1 from a negative
                    (the same position of another row in the batch), MLP 100-50-1
    a_t = attention(query, h_t) over valid positions           (DIN's unit)
    AUGRU: the update gate of each step is scaled by a_t       (interest evolution)
    logit = MLP 200-80 (batch norm) over [user, item, final state, dense]
    loss  = BCE(click) + aux_weight * auxiliary loss
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deeprec.data.schema import Schema
from deeprec.graph.capture import leaf_module
from deeprec.models.common import MLP
from deeprec.models.din import AttentionPooling, BehaviorInputs
from deeprec.models.features import label_columns


@dataclass
class DIENConfig:
    embedding_dim: int = 18
    hash_buckets: int = 100_000
    max_length: int = 50
    attention: tuple[int, ...] = (80, 40)
    auxiliary: tuple[int, ...] = (100, 50)
    top: tuple[int, ...] = (200, 80)
    batch_norm: bool = True
    aux_weight: float = 1.0
    embedding: str = "variable"  # variable (EmbeddingVariable, no buckets) | table | torch
    label: str | None = None


@leaf_module  # its loop over steps is one graph node when forward is traced
class AUGRU(nn.Module):
    """GRU whose update gate is scaled by an attention score per step; padded steps keep the state."""

    def __init__(self, width: int):
        super().__init__()
        self.gates = nn.Linear(2 * width, 2 * width)  # reset, update
        self.candidate = nn.Linear(2 * width, width)

    def forward(self, inputs: torch.Tensor, attention: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        state = inputs.new_zeros(inputs.shape[0], inputs.shape[2])
        for t in range(inputs.shape[1]):
            x = inputs[:, t]
            reset, update = torch.sigmoid(self.gates(torch.cat([x, state], dim=1))).chunk(2, dim=1)
            candidate = torch.tanh(self.candidate(torch.cat([x, reset * state], dim=1)))
            update = attention[:, t:t + 1] * update
            new = (1 - update) * state + update * candidate
            state = torch.where(mask[:, t:t + 1], new, state)
        return state


class DIEN(nn.Module):
    def __init__(self, config: DIENConfig | None = None, schema: Schema | None = None, **overrides):
        super().__init__()
        from deeprec.data.presets import BEHAVIOR_SCHEMA

        self.config = config = config or DIENConfig(**overrides)
        self.schema = schema or BEHAVIOR_SCHEMA
        self.label_columns = label_columns(self.schema, config.label)
        self.inputs = BehaviorInputs(self.schema, config.embedding_dim, config.hash_buckets, config.max_length,
                                     config.embedding)
        width = self.inputs.key_width
        self.extractor = nn.GRU(width, width, batch_first=True)
        self.auxiliary = MLP(2 * width, config.auxiliary, out=1)
        self.attention = AttentionPooling(width, config.attention)
        self.evolution = AUGRU(width)
        self.top = MLP(self.inputs.top_width, config.top, out=1, batch_norm=config.batch_norm)

    def auxiliary_loss(self, interests, keys, mask) -> torch.Tensor:
        """h_t against the next item (1) and against another row's item at t+1 (0)."""
        negatives = keys.roll(1, dims=0)
        h, positive, negative = interests[:, :-1], keys[:, 1:], negatives[:, 1:]
        valid = (mask[:, 1:] & mask.roll(1, dims=0)[:, 1:]).to(h.dtype)
        pos = self.auxiliary(torch.cat([h, positive], dim=-1)).squeeze(-1)
        neg = self.auxiliary(torch.cat([h, negative], dim=-1)).squeeze(-1)
        losses = (F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos), reduction="none")
                  + F.binary_cross_entropy_with_logits(neg, torch.zeros_like(neg), reduction="none"))
        return (losses * valid).sum() / valid.sum().clamp_min(1.0)

    def forward(self, batch: dict) -> dict:
        query, keys, mask, side = self.inputs(batch)
        interests, _ = self.extractor(keys)  # left-aligned: steps before the padding are exact
        scores = self.attention.weights(query, interests, mask)
        final = self.evolution(interests, scores, mask)
        logits = self.top(torch.cat([*side, final], dim=1)).squeeze(1)
        click = F.binary_cross_entropy_with_logits(logits, batch[self.label_columns[0]])
        aux = self.auxiliary_loss(interests, keys, mask)
        return {"loss": click + self.config.aux_weight * aux, "logits": logits, "click_loss": click.detach(),
                "aux_loss": aux.detach()}
