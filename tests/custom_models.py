"""Models written the way users write their own (none from deeprec.models), for
tests/test_custom_models.py. Each takes the raw batch of a reader (Criteo columns:
label, I1..I13 dense with NaN, C1..C26 strings) or, for the sequence model, a
behaviour batch (`behavior_batch`), and returns {"loss", "logits"}."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import deeprec as dr

DIM = 8


def _dense(batch, names=("I1", "I2", "I3")) -> torch.Tensor:
    return torch.log1p(torch.nan_to_num(torch.stack([batch[n] for n in names], 1), nan=0.0).clamp(min=0.0))


def _click(logit: torch.Tensor, batch) -> dict:
    return {"loss": F.binary_cross_entropy_with_logits(logit, batch["label"]), "logits": logit}


class EVAlone(nn.Module):
    """The smallest model: one EmbeddingVariable and a linear layer (issue #31)."""

    def __init__(self):
        super().__init__()
        self.ev = dr.EmbeddingVariable(DIM, name="item")
        self.fc = nn.Linear(DIM, 1)

    def forward(self, batch):
        e = self.ev(dr.ops.string_to_hash_key(batch["C1"]))
        return _click(self.fc(e).squeeze(-1), batch)


class EVList(nn.Module):
    """EmbeddingVariables in an nn.ModuleList, one per column, hashed in one op call."""

    columns = ("C1", "C2", "C3", "C4")

    def __init__(self):
        super().__init__()
        self.tables = nn.ModuleList(dr.EmbeddingVariable(DIM, name=c) for c in self.columns)
        self.mlp = nn.Sequential(nn.Linear(3 + DIM * len(self.columns), 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, batch):
        keys = dr.ops.string_to_hash_key([batch[c] for c in self.columns])
        embedded = [table(k) for table, k in zip(self.tables, keys)]
        return _click(self.mlp(torch.cat([_dense(batch), *embedded], 1)).squeeze(1), batch)


class SharedEmbedding(nn.Module):
    """One EmbeddingVariable for two columns (called twice): e.g. a query and a clicked item id."""

    def __init__(self):
        super().__init__()
        self.ids = dr.EmbeddingVariable(DIM, name="shared")
        self.head = nn.Linear(2 * DIM + 3, 1)

    def forward(self, batch):
        a, b = dr.ops.string_to_hash_key([batch["C3"], batch["C4"]])
        x = torch.cat([self.ids(a), self.ids(b), _dense(batch)], 1)
        return _click(self.head(x).squeeze(1), batch)


class TwoTower(nn.Module):
    """Retrieval: a user tower (EmbeddingCollection of EmbeddingVariables + dense) and an item tower
    (hashed nn.Embedding tables); the logit is their dot product."""

    def __init__(self, buckets: int = 500):
        super().__init__()
        self.buckets = buckets
        self.user_emb = dr.EmbeddingCollection([dr.nn.EmbeddingFeature(c) for c in ("C1", "C2")], DIM)
        self.item_emb = nn.ModuleDict({c: nn.Embedding(buckets, DIM) for c in ("C5", "C6")})
        self.user = nn.Sequential(nn.Linear(2 * DIM + 3, 16), nn.ReLU(), nn.Linear(16, DIM))
        self.item = nn.Sequential(nn.Linear(2 * DIM, 16), nn.ReLU(), nn.Linear(16, DIM))

    def forward(self, batch):
        user_keys = dr.ops.string_to_hash_key([batch["C1"], batch["C2"]])
        pooled = self.user_emb({"C1": user_keys[0], "C2": user_keys[1]})  # [B, 2, D]
        u = self.user(torch.cat([pooled.flatten(1), _dense(batch)], 1))
        buckets = dr.ops.string_to_hash_bucket([batch["C5"], batch["C6"]], self.buckets)
        v = self.item(torch.cat([self.item_emb[c](ids) for c, ids in zip(("C5", "C6"), buckets)], 1))
        return _click((F.normalize(u, dim=1) * F.normalize(v, dim=1)).sum(1) * 5.0, batch)


class WideAndDeep(nn.Module):
    """Wide: a crossed feature (C1 x C2) and C3, each a hashed bucket weight (EmbeddingBag, dim 1);
    deep: EmbeddingVariables and the dense columns through an MLP."""

    def __init__(self, buckets: int = 1000):
        super().__init__()
        self.buckets = buckets
        self.wide = nn.EmbeddingBag(2 * buckets, 1, mode="sum")
        self.deep_emb = nn.ModuleDict({c: dr.EmbeddingVariable(DIM, name=c) for c in ("C4", "C5")})
        self.deep = nn.Sequential(nn.Linear(2 * DIM + 3, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, batch):
        cross = dr.ops.cross_hash_bucket([batch["C1"], batch["C2"]], self.buckets)
        c3 = dr.ops.string_to_hash_bucket(batch["C3"], self.buckets) + self.buckets  # its own id range
        wide = self.wide(torch.stack([cross, c3], 1)).squeeze(1)
        keys = dr.ops.string_to_hash_key([batch["C4"], batch["C5"]])
        deep_in = torch.cat([self.deep_emb["C4"](keys[0]), self.deep_emb["C5"](keys[1]), _dense(batch)], 1)
        return _click(wide + self.deep(deep_in).squeeze(1), batch)


class MultiTask(nn.Module):
    """Two tasks on a shared bottom: click (the label) and "heavy user" (I2 > 1); logits [B, 2]."""

    def __init__(self):
        super().__init__()
        self.emb = nn.ModuleDict({c: dr.EmbeddingVariable(DIM, name=c) for c in ("C1", "C2", "C3")})
        self.bottom = nn.Sequential(nn.Linear(3 * DIM + 3, 16), nn.ReLU())
        self.towers = nn.ModuleList(nn.Linear(16, 1) for _ in range(2))

    def forward(self, batch):
        keys = dr.ops.string_to_hash_key([batch[c] for c in ("C1", "C2", "C3")])
        shared = self.bottom(torch.cat([self.emb[c](k) for c, k in zip(("C1", "C2", "C3"), keys)]
                                       + [_dense(batch)], 1))
        logits = torch.cat([tower(shared) for tower in self.towers], 1)
        labels = torch.stack([batch["label"], (torch.nan_to_num(batch["I2"], nan=0.0) > 1).float()], 1)
        return {"loss": F.binary_cross_entropy_with_logits(logits, labels), "logits": logits}


@dr.op
def count_buckets(counts: torch.Tensor) -> torch.Tensor:
    """A user's own preprocessing, with numpy and Python branching: log2 buckets of a count
    (missing -> bucket 0), capped at 15."""
    values = counts.numpy()
    out = np.zeros(values.shape, dtype=np.int64)
    present = ~np.isnan(values)
    if present.any():
        out[present] = np.minimum(np.floor(np.log2(np.maximum(values[present], 0.0) + 1.0)) + 1, 15)
    return torch.from_numpy(out)


class OwnOpModel(nn.Module):
    """Its own @dr.op preprocessing (count buckets) feeding nn.Embedding, and an EmbeddingVariable."""

    def __init__(self):
        super().__init__()
        self.count_emb = nn.Embedding(16, DIM)
        self.ev = dr.EmbeddingVariable(DIM, name="C7")
        self.head = nn.Linear(2 * DIM, 1)

    def forward(self, batch):
        x = torch.cat([self.count_emb(count_buckets(batch["I5"])), self.ev(dr.ops.string_to_hash_key(batch["C7"]))], 1)
        return _click(self.head(x).squeeze(1), batch)


class HashedTorchEmbeddings(nn.Module):
    """Only torch's layers: nn.Embedding and nn.EmbeddingBag (mean) over hashed buckets."""

    def __init__(self, buckets: int = 300):
        super().__init__()
        self.buckets = buckets
        self.single = nn.Embedding(buckets, DIM)
        self.bag = nn.EmbeddingBag(buckets, DIM, mode="mean")
        self.head = nn.Linear(2 * DIM + 3, 1)

    def forward(self, batch):
        c1, c2, c3 = dr.ops.string_to_hash_bucket([batch["C1"], batch["C2"], batch["C3"]], self.buckets)
        x = torch.cat([self.single(c1), self.bag(torch.stack([c2, c3], 1)), _dense(batch)], 1)
        return _click(self.head(x).squeeze(1), batch)


class CollectionModel(nn.Module):
    """An EmbeddingCollection of fixed-size hashed tables (sum and mean combiners)."""

    columns = ("C1", "C2", "C3", "C4")

    def __init__(self, buckets: int = 400):
        super().__init__()
        self.buckets = buckets
        self.emb = dr.EmbeddingCollection([dr.nn.EmbeddingFeature(c, buckets, combiner="mean" if i % 2 else "sum")
                                           for i, c in enumerate(self.columns)], DIM)
        self.mlp = nn.Sequential(nn.Linear(len(self.columns) * DIM + 3, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, batch):
        ids = dr.ops.string_to_hash_bucket([batch[c] for c in self.columns], self.buckets)
        pooled = self.emb(dict(zip(self.columns, ids)))
        return _click(self.mlp(torch.cat([pooled.flatten(1), _dense(batch)], 1)).squeeze(1), batch)


class SequenceAttention(nn.Module):
    """A behaviour model: the target item attends over the user's history of items; one
    EmbeddingVariable embeds both (history padded to `max_length`, padding masked)."""

    def __init__(self, max_length: int = 6):
        super().__init__()
        self.max_length = max_length
        self.items = dr.EmbeddingVariable(DIM, name="item")
        self.users = nn.Embedding(50, DIM)
        self.attention = nn.Sequential(nn.Linear(4 * DIM, 16), nn.ReLU(), nn.Linear(16, 1))
        self.head = nn.Sequential(nn.Linear(3 * DIM, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, batch):
        target = self.items(batch["item_id"])  # [B, D]
        ids, mask = dr.ops.pad_ragged(batch["hist_items"], self.max_length, -1)
        history = self.items(ids) * mask.unsqueeze(-1)  # [B, L, D]
        query = target.unsqueeze(1).expand_as(history)
        scores = self.attention(torch.cat([query, history, query - history, query * history], -1)).squeeze(-1)
        weights = torch.softmax(scores.masked_fill(~mask, -1e9), dim=1) * mask  # an empty history pools to 0
        pooled = (weights.unsqueeze(-1) * history).sum(1)
        user = self.users(torch.remainder(batch["user_id"], 50))
        return _click(self.head(torch.cat([target, pooled, user], 1)).squeeze(1), batch)


def behavior_batch(rows: int = 24, seed: int = 0) -> dict:
    """A raw behaviour batch as a reader yields one: int ids, a Ragged history (some empty), labels."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 9, (rows,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return {"label": torch.randint(0, 2, (rows,), generator=g).float(),
            "user_id": torch.randint(0, 1000, (rows,), generator=g),
            "item_id": torch.randint(0, 60, (rows,), generator=g),
            "hist_items": dr.Ragged(torch.randint(0, 60, (int(offsets[-1]),), generator=g), offsets)}


class SharedNames(nn.Module):
    """One EmbeddingVariable registered under two names of a ModuleDict (C1 and C2 draw from one
    vocabulary), as a user shares a table between two features."""

    def __init__(self):
        super().__init__()
        shared = dr.EmbeddingVariable(DIM, name="C1_C2")
        self.evs = nn.ModuleDict({"C1": shared, "C2": shared})
        self.head = nn.Linear(2 * DIM + 3, 1)

    def forward(self, batch):
        keys = dr.ops.string_to_hash_key([batch["C1"], batch["C2"]])
        x = torch.cat([self.evs["C1"](keys[0]), self.evs["C2"](keys[1]), _dense(batch)], 1)
        return _click(self.head(x).squeeze(1), batch)


class MixedEmbeddings(nn.Module):
    """Every kind of embedding a user writes, in one model: an EmbeddingVariable shared under two
    names (C1 and C2); an EmbeddingVariable over a crossed feature (C3 x C4, hashed to 62 bits); a
    plain nn.Embedding over hash buckets (C5); a dense value bucketized (I1, missing -> bucket 0),
    embedded; the log of the first dense columns."""

    boundaries = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0)

    def __init__(self, buckets: int = 200):
        super().__init__()
        self.buckets = buckets
        shared = dr.EmbeddingVariable(DIM, name="C1_C2")
        self.evs = nn.ModuleDict({"C1": shared, "C2": shared, "C3_X_C4": dr.EmbeddingVariable(DIM, name="C3_X_C4")})
        self.hashed = nn.Embedding(buckets, DIM)
        self.counts = nn.Embedding(len(self.boundaries) + 1, DIM)
        self.mlp = nn.Sequential(nn.Linear(5 * DIM + 3, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, batch):
        c1, c2 = dr.ops.string_to_hash_key([batch["C1"], batch["C2"]])
        crossed = dr.ops.cross_hash_bucket([batch["C3"], batch["C4"]], 2**62)
        c5 = dr.ops.string_to_hash_bucket(batch["C5"], self.buckets)
        i1 = dr.ops.bucketize(dr.ops.fill_missing(batch["I1"], -1.0), self.boundaries)
        x = torch.cat([self.evs["C1"](c1), self.evs["C2"](c2), self.evs["C3_X_C4"](crossed), self.hashed(c5),
                       self.counts(i1), _dense(batch)], 1)
        return _click(self.mlp(x).squeeze(1), batch)
