"""DIN (Zhou et al. 2018), DeepRec modelzoo sizes: attention over the behaviour sequence.

    query   = embeddings of the target item's columns          [B, E]
    keys    = embeddings of the history, per position           [B, L, E]
    weights = softmax over valid positions of MLP 80-40-1([q, k, q - k, q * k])
    interest = sum_t weights_t * keys_t      (an empty history: a learned vector, zero at init)
    logit   = MLP 200-80 (batch norm) over [user, item, interest, dense] -> 1

History columns that `embed_with` an item column share its table, so the query
is those columns' embeddings; otherwise a linear map brings the item side to the
history's width.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deeprec.data.schema import Schema
from deeprec.errors import ConfigError, check_choice
from deeprec.models.common import MLP
from deeprec.models.features import FeatureEmbedder, binary_head, label_columns


@dataclass
class DINConfig:
    embedding_dim: int = 18
    hash_buckets: int = 100_000
    max_length: int = 50
    attention: tuple[int, ...] = (80, 40)
    top: tuple[int, ...] = (200, 80)
    batch_norm: bool = True
    empty_history: str = "learned"  # learned | zero: the interest of a row without history
    embedding: str = "variable"  # variable (EmbeddingVariable, no buckets) | table | torch
    label: str | None = None  # default: the schema's first label


class AttentionPooling(nn.Module):
    """DIN's local activation unit: a weighted sum of the keys, weights from the query.

    `learned_empty`: a row without history pools a learned vector (`empty`, zero at init) instead
    of a fixed zero. A zero interest is what a history unrelated to the target looks like, so the top
    MLP scores those rows as non-matches; DeepCTR-Torch's DIN (uniform attention over the padding
    row's embedding) learns such a vector too (bench/din_diag.py measures the difference)."""

    def __init__(self, width: int, hidden: tuple[int, ...], learned_empty: bool = False):
        super().__init__()
        layers, in_dim = [], 4 * width
        for h in hidden:
            layers += [nn.Linear(in_dim, h), nn.Sigmoid()]
            in_dim = h
        self.score = nn.Sequential(*layers, nn.Linear(in_dim, 1))
        self.empty = nn.Parameter(torch.zeros(width)) if learned_empty else None

    def weights(self, query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = query.unsqueeze(1).expand_as(keys)
        scores = self.score(torch.cat([q, keys, q - keys, q * keys], dim=-1)).squeeze(-1)
        scores = scores.masked_fill(~mask, -1e9)
        return torch.softmax(scores.float(), dim=1).to(keys.dtype) * mask  # empty history: all zero

    def forward(self, query, keys, mask):
        interest = (self.weights(query, keys, mask).unsqueeze(-1) * keys).sum(1)
        if self.empty is None:
            return interest
        return torch.where(mask.any(1, keepdim=True), interest, self.empty.to(interest.dtype))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self.empty is not None and prefix + "empty" not in state_dict:  # saved before `empty`: its zero
            state_dict[prefix + "empty"] = torch.zeros_like(self.empty)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class BehaviorInputs(nn.Module):
    """The user side, the target item (query) and the history (keys) of a schema."""

    def __init__(self, schema: Schema, dim: int, hash_buckets: int, max_length: int, embedding: str = "variable"):
        super().__init__()
        self.embedder = FeatureEmbedder(schema, dim, hash_buckets, max_length, embedding=embedding)
        self.history = self.embedder.columns("sequence")
        if not self.history:
            raise ConfigError(f"the {schema.name} schema has no sequence column: DIN/DIEN need a behaviour history")
        lengths = {self.embedder.length(h) for h in self.history}
        if len(lengths) > 1:
            raise ConfigError(f"history columns {', '.join(self.history)} must share one max_length, got {lengths}")
        self.items = self.embedder.columns("categorical", "item")
        self.users = [c for c in self.embedder.columns("categorical") if c not in self.items]
        self.dense = self.embedder.columns("dense")
        if not self.items:
            raise ConfigError(f"the {schema.name} schema marks no categorical column role='item' (the target)")
        paired = [schema[h].embed_with for h in self.history]
        self.paired = paired if all(p in self.items for p in paired) else None
        self.key_width = len(self.history) * dim
        self.item_width = len(self.items) * dim
        self.project = None if self.paired else nn.Linear(self.item_width, self.key_width)

    @property
    def top_width(self) -> int:
        return len(self.users) * self.embedder.dim + self.item_width + self.key_width + len(self.dense)

    def forward(self, batch: dict):
        e = self.embedder
        embedded = e(batch)
        items = {name: e.column(embedded, name) for name in self.items}
        item = torch.cat(list(items.values()), dim=1)
        query = torch.cat([items[p] for p in self.paired], dim=1) if self.paired else self.project(item)
        keys = torch.cat([embedded.sequences[name] for name in self.history], dim=-1)
        mask = embedded.masks[self.history[0]]
        side = [e.column(embedded, name) for name in self.users] + [item]
        if self.dense:
            side.append(embedded.dense)
        return query, keys, mask, side


class DIN(nn.Module):
    def __init__(self, config: DINConfig | None = None, schema: Schema | None = None, **overrides):
        super().__init__()
        from deeprec.data.presets import BEHAVIOR_SCHEMA

        self.config = config = config or DINConfig(**overrides)
        self.schema = schema or BEHAVIOR_SCHEMA
        self.label_columns = label_columns(self.schema, config.label)
        check_choice("empty_history", config.empty_history, ("learned", "zero"))
        self.inputs = BehaviorInputs(self.schema, config.embedding_dim, config.hash_buckets, config.max_length,
                                     config.embedding)
        self.attention = AttentionPooling(self.inputs.key_width, config.attention,
                                          learned_empty=config.empty_history == "learned")
        self.top = MLP(self.inputs.top_width, config.top, out=1, batch_norm=config.batch_norm)

    def forward(self, batch: dict) -> dict:
        query, keys, mask, side = self.inputs(batch)
        interest = self.attention(query, keys, mask)
        logits = self.top(torch.cat([*side, interest], dim=1)).squeeze(1)
        return binary_head(logits, batch, self.label_columns[0])
