"""Evaluation in bounded memory: AUC and log loss accumulated batch by batch.

    batch ──model──> logits ──p = sigmoid──> histogram of p per class (BINS bins of [0, 1])
                                       └──> sum of the log loss (float64)

AUC is read off the two histograms: a positive ranks above every negative of a lower
bin and half above those of its own bin. Only pairs inside one bin can be wrong, so
the error is at most `auc_error_bound` = 0.5 * sum_b pos_b * neg_b / (P * N), which is
reported with the AUC (about 1e-6 on Criteo-like predictions; 0 when no bin holds both
classes). Memory: 2 x BINS int64 per task (16 MiB), whatever the number of rows.
Log loss is exact, computed as scikit-learn's log_loss (p clipped to [eps, 1 - eps]).

Ranking metrics, where the schema or the model gives what they need:
    GAUC          the DIN paper's user-grouped AUC (`GroupedAUC`): schemas with a user column
    Recall@K, NDCG@K   retrieval of two-tower models (`RetrievalMetrics`): models with `retrieval_vectors`
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deeprec.progress import progress as show_progress
from deeprec.ragged import Ragged

BINS = 1 << 20
GAUC_MAX_ROWS = 1 << 24  # rows kept exactly (13 bytes each: ~220 MB); past it users are sampled
RECALL_AT = (5, 10)
RETRIEVAL_CANDIDATES = 100  # as NCF's protocol ranks a positive among 100 items


class StreamingMetrics:
    """AUC (bucketed, error bound stated) and log loss of one binary task."""

    def __init__(self, bins: int = BINS):
        self.bins = bins
        self.pos = np.zeros(bins, dtype=np.int64)
        self.neg = np.zeros(bins, dtype=np.int64)
        self.loss_sum, self.rows = 0.0, 0

    def update(self, labels: np.ndarray, logits: np.ndarray) -> None:
        y = labels.astype(np.float64) >= 0.5
        p = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
        where = np.minimum((p * self.bins).astype(np.int64), self.bins - 1)
        self.pos += np.bincount(where[y], minlength=self.bins)
        self.neg += np.bincount(where[~y], minlength=self.bins)
        eps = np.finfo(np.float64).eps  # scikit-learn's log_loss clipping
        clipped = np.clip(p, eps, 1 - eps)
        self.loss_sum += float(-(np.log(clipped[y]).sum() + np.log1p(-clipped[~y]).sum()))
        self.rows += len(y)

    def result(self) -> dict:
        positives, negatives = int(self.pos.sum()), int(self.neg.sum())
        pairs = positives * negatives
        if pairs:
            below = np.cumsum(self.neg) - self.neg  # negatives in lower bins
            auc = float((self.pos * (below + 0.5 * self.neg)).sum() / pairs)
            bound = float(0.5 * (self.pos * self.neg).sum() / pairs)
        else:  # undefined for one class
            auc, bound = float("nan"), 0.0
        logloss = self.loss_sum / self.rows if self.rows else float("nan")
        return {"auc": auc, "auc_error_bound": bound, "logloss": logloss}


def _mix64(keys: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: user ids spread evenly over 64 bits (the sample keeps a hash range)."""
    z = keys.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def column_keys(column) -> np.ndarray:
    """A raw batch's categorical column as int64 keys: int ids as they are, strings by their 63-bit
    hash (deeprec.ops.string_to_hash_key, as EmbeddingVariables key them)."""
    if isinstance(column, Ragged):
        from deeprec.ops import string_to_hash_key

        column = string_to_hash_key(column)
    return column.detach().cpu().numpy().astype(np.int64, copy=False)


class GroupedAUC:
    """GAUC (Zhou et al., DIN, 2018): the AUC of each user's impressions, averaged with the user's
    impression count as weight, over the users who have both a click and a non-click.

    Rows are kept compactly (user key, float32 score, label: 13 bytes) and ranked per user at the end,
    exactly (ties at their mid-rank, as scikit-learn's roc_auc_score). Memory is bounded: past
    `max_rows` rows, half of the users (by a hash of their key) are dropped, as often as needed; the
    result is then the GAUC of that uniform sample of users, and says so (`gauc_sampled`: the share kept)."""

    def __init__(self, max_rows: int = GAUC_MAX_ROWS):
        self.max_rows, self.level = max_rows, 0  # keep users whose hash has `level` low zero bits
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.rows = 0

    def _keep(self, groups: np.ndarray) -> np.ndarray:
        return (_mix64(groups) & np.uint64((1 << self.level) - 1)) == 0

    def update(self, groups: np.ndarray, labels: np.ndarray, logits: np.ndarray) -> None:
        part = (np.asarray(groups, np.int64), np.asarray(logits, np.float32), np.asarray(labels) >= 0.5)
        if self.level:
            keep = self._keep(part[0])
            part = tuple(a[keep] for a in part)
        self.parts.append(part)
        self.rows += len(part[0])
        self._bound()

    def _bound(self) -> None:
        """Halve the users kept (by hash) until at most `max_rows` rows are."""
        while self.rows > self.max_rows:
            self.level += 1
            self._resample()

    def _resample(self) -> None:
        self.parts = [tuple(a[keep] for a in p) for p in self.parts for keep in [self._keep(p[0])]]
        self.rows = sum(len(p[0]) for p in self.parts)

    def merge(self, other: "GroupedAUC") -> None:
        """Add another's rows (another rank's): both are brought to the coarser sample, and the union
        is bounded by `max_rows` as one pass over all the rows would be."""
        self.level = max(self.level, other.level)
        self.parts = self.parts + other.parts
        self._resample()
        self._bound()

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self.parts:
            return np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, bool)
        return tuple(np.concatenate(a) for a in zip(*self.parts))

    def result(self) -> dict:
        groups, scores, labels = self.arrays()
        order = np.lexsort((scores, groups))
        groups, scores, labels = groups[order], scores[order], labels[order]
        n = len(groups)
        new_group = np.r_[True, groups[1:] != groups[:-1]] if n else np.zeros(0, bool)
        new_tie = new_group | np.r_[True, scores[1:] != scores[:-1]] if n else new_group
        user = np.cumsum(new_group) - 1
        group_start = np.flatnonzero(new_group)
        tie = np.cumsum(new_tie) - 1
        tie_start = np.flatnonzero(new_tie)
        tie_end = np.r_[tie_start[1:], n]
        rank = (tie_start[tie] + tie_end[tie] - 1) / 2.0 - group_start[user] + 1  # 1-based mid-rank in the user
        users = len(group_start)
        size = np.bincount(user, minlength=users).astype(np.float64)
        positives = np.bincount(user, weights=labels, minlength=users)
        negatives = size - positives
        rank_sum = np.bincount(user, weights=np.where(labels, rank, 0.0), minlength=users)
        both = (positives > 0) & (negatives > 0)
        auc = (rank_sum[both] - positives[both] * (positives[both] + 1) / 2) / (positives[both] * negatives[both])
        weights = size[both]
        gauc = float((auc * weights).sum() / weights.sum()) if both.any() else float("nan")
        out = {"gauc": gauc, "gauc_users": int(both.sum()), "gauc_rows": int(weights.sum())}
        if self.level:
            out["gauc_sampled"] = 1.0 / (1 << self.level)
        return out


class RetrievalMetrics:
    """Recall@K and NDCG@K of a two-tower model, streaming in bounded memory.

    Each evaluation row with a click is a query: its user's vector ranks its item among `candidates`
    others, the most recent distinct items of the evaluation data (a pool kept as vectors, refreshed
    batch by batch; the query's own item, if in it, does not count against it). rank = 1 + candidates scored above it;
    Recall@K = share of queries with rank <= K, NDCG@K = mean of 1 / log2(1 + rank) over those (one
    relevant item: the ideal DCG is 1). Queries count once the pool is full, so every one ranks
    among the same number of items; while it fills, a batch's items join it before its queries rank. The model gives the vectors: `model.retrieval_vectors(batch)`
    -> (user [B, D], item [B, D]) whose dot product orders items as its logit does."""

    def __init__(self, ks=RECALL_AT, candidates: int = RETRIEVAL_CANDIDATES):
        self.ks, self.candidates = tuple(ks), candidates
        self.pool_keys = np.zeros(0, np.int64)
        self.pool = None  # [n, D] float32 tensor
        self.queries = 0
        self.hits = np.zeros(len(self.ks))
        self.dcg = np.zeros(len(self.ks))

    def update(self, items: np.ndarray, labels: np.ndarray, user: torch.Tensor, item: torch.Tensor) -> None:
        user, item = user.detach().float().cpu(), item.detach().float().cpu()
        clicked = np.flatnonzero(np.asarray(labels) >= 0.5)
        filling = len(self.pool_keys) < self.candidates
        if filling:  # the first batch's queries rank among its own items
            self._refresh(items, item)
        if len(clicked) and len(self.pool_keys) >= self.candidates:
            queries = torch.from_numpy(clicked)
            own = (user[queries] * item[queries]).sum(1, keepdim=True)
            scores = user[queries] @ self.pool.T
            same = torch.from_numpy(items[clicked][:, None] == self.pool_keys[None, :])
            ranks = 1 + ((scores > own) & ~same).sum(1).numpy()
            for j, k in enumerate(self.ks):
                hit = ranks <= k
                self.hits[j] += hit.sum()
                self.dcg[j] += (hit / np.log2(1 + ranks)).sum()
            self.queries += len(clicked)
        if not filling:
            self._refresh(items, item)

    def _refresh(self, items: np.ndarray, item: torch.Tensor) -> None:
        """The batch's distinct items (their last row's vector) become the newest of the pool."""
        keys, first = np.unique(items[::-1], return_index=True)
        last = len(items) - 1 - first
        order = np.argsort(last)  # the newest last: the pool drops its oldest
        keys, rows = keys[order], torch.from_numpy(last[order].astype(np.int64))
        old = ~np.isin(self.pool_keys, keys)
        kept_keys = self.pool_keys[old]
        kept = self.pool[torch.from_numpy(old)] if self.pool is not None else item[:0]
        self.pool_keys = np.concatenate([kept_keys, keys])[-self.candidates:]
        self.pool = torch.cat([kept, item[rows]])[-self.candidates:]

    def result(self) -> dict:
        out = {"retrieval_queries": self.queries, "retrieval_candidates": self.candidates}
        for j, k in enumerate(self.ks):
            out[f"recall@{k}"] = self.hits[j] / self.queries if self.queries else float("nan")
            out[f"ndcg@{k}"] = self.dcg[j] / self.queries if self.queries else float("nan")
        return out


def ranking_columns(schema) -> dict:
    """`group_by` and `item_by` of the evaluation: the schema's first categorical column with role
    "user" (GAUC groups by it) and with role "item" (retrieval metrics key candidates by it)."""
    def first(role):
        return next((c.name for c in schema.columns if c.kind == "categorical" and c.role == role), None)

    return {} if schema is None else {"group_by": first("user"), "item_by": first("item")}


class Evaluation:
    """StreamingMetrics of every task of a model: fed batch by batch, summed across ranks; GAUC of the
    first task when `group_by` names the user column; Recall@K / NDCG@K when `item_by` names the item
    column and the model has `retrieval_vectors`."""

    def __init__(self, model: torch.nn.Module, group_by: str | None = None, item_by: str | None = None):
        self.names = tuple(getattr(model, "label_columns", ("label",)))
        self.metrics = [StreamingMetrics() for _ in self.names]
        self.group_by = group_by
        self.grouped = GroupedAUC() if group_by else None
        self.item_by = item_by if item_by and callable(getattr(model, "retrieval_vectors", None)) else None
        self.retrieval = RetrievalMetrics() if self.item_by else None

    def update(self, batch: dict, logits: torch.Tensor, vectors=None) -> None:
        logits = (logits if logits.dim() == 2 else logits.unsqueeze(1)).detach().float().cpu().numpy()
        for k, name in enumerate(self.names):
            self.metrics[k].update(batch[name].cpu().numpy(), logits[:, k])
        labels = batch[self.names[0]].cpu().numpy()
        if self.grouped is not None:
            self.grouped.update(column_keys(batch[self.group_by]), labels, logits[:, 0])
        if self.retrieval is not None and vectors is not None:
            self.retrieval.update(column_keys(batch[self.item_by]), labels, *vectors)

    def all_reduce(self, group=None, device: torch.device | None = None) -> None:
        """Every rank's histograms and sums added up (torch.distributed; `device`: the group's, a GPU
        under NCCL), so each holds the whole."""
        import torch.distributed as dist

        for m in self.metrics:
            counts = torch.from_numpy(np.stack([m.pos, m.neg])).to(device)
            sums = torch.tensor([m.loss_sum, float(m.rows)], dtype=torch.float64, device=device)
            dist.all_reduce(counts, group=group)
            dist.all_reduce(sums, group=group)
            counts, sums = counts.cpu(), sums.cpu()
            m.pos, m.neg = counts[0].numpy(), counts[1].numpy()
            m.loss_sum, m.rows = float(sums[0]), int(sums[1])
        if self.grouped is not None:
            self._gather_grouped(group, device)
        if self.retrieval is not None:  # counts add up (each rank's queries ranked in its own pool)
            r = self.retrieval
            sums = torch.tensor([float(r.queries), *r.hits, *r.dcg], dtype=torch.float64, device=device)
            dist.all_reduce(sums, group=group)
            sums = sums.cpu().numpy()
            r.queries, r.hits, r.dcg = int(sums[0]), sums[1:1 + len(r.ks)], sums[1 + len(r.ks):]

    def _gather_grouped(self, group, device) -> None:
        """Every rank's GAUC rows gathered (a user's rows may sit on several ranks)."""
        import torch.distributed as dist

        mine = self.grouped.arrays()
        size = torch.tensor([len(mine[0]), self.grouped.level], device=device)
        sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, size, group=group)
        longest = max(int(s[0]) for s in sizes)
        packed = torch.zeros(3, longest, dtype=torch.float64)
        packed[0, :len(mine[0])] = torch.from_numpy(mine[0].view(np.float64))  # the int64 bits, carried as is
        packed[1, :len(mine[0])] = torch.from_numpy(mine[1].astype(np.float64))
        packed[2, :len(mine[0])] = torch.from_numpy(mine[2].astype(np.float64))
        gathered = [torch.zeros_like(packed, device=device) for _ in sizes]
        dist.all_gather(gathered, packed.to(device), group=group)
        merged = GroupedAUC(self.grouped.max_rows)
        for rows, part in zip(sizes, gathered):
            n, part = int(rows[0]), part.cpu().numpy()
            other = GroupedAUC(self.grouped.max_rows)
            other.level = int(rows[1])
            other.parts = [(part[0, :n].view(np.int64).copy(), part[1, :n].astype(np.float32), part[2, :n] > 0.5)]
            merged.merge(other)
        self.grouped = merged

    def result(self) -> dict:
        rows = self.metrics[0].rows
        if not rows:
            return {"rows": 0, "auc": float("nan"), "logloss": float("nan")}
        tasks = {name: m.result() for name, m in zip(self.names, self.metrics)}
        result = {"rows": rows, **tasks[self.names[0]]}
        if self.grouped is not None:
            result.update(self.grouped.result())
        if self.retrieval is not None:
            result.update(self.retrieval.result())
        if len(self.names) > 1:
            result["tasks"] = tasks
        return result


@dataclass(frozen=True)
class Uncounted:
    """A batch the model runs on but the metrics do not count. Lockstep evaluation (collective
    training) yields these: a rank whose share has ended runs its last batch again, so that the
    other ranks' lookups, which exchange ids with it, get their answers."""

    batch: dict


@torch.no_grad()
def run_evaluation(model: torch.nn.Module, batches, *, progress=None, description: str = "evaluate",
                   on_logits=None, group_by: str | None = None, item_by: str | None = None) -> Evaluation:
    """The evaluation loop: `model` in eval mode (its mode restored after) over one pass of
    `batches`, each batch's predictions counted into an Evaluation (an `Uncounted` batch only runs).
    `progress`: rows evaluated and rows/s shown on a terminal (None or True: deeprec.progress's
    shared console, False: never, or a rich Console). `on_logits(logits)`: called with each counted
    batch's logits, in order (per-row predictions: `deeprec evaluate --predictions`). `group_by` /
    `item_by`: the user and item columns of GAUC and retrieval metrics (`ranking_columns(schema)`)."""
    evaluation = Evaluation(model, group_by, item_by)
    vectors = model.retrieval_vectors if evaluation.retrieval is not None else None
    rows = evaluation.metrics[0]  # its row count grows with every batch
    was_training = model.training
    model.eval()
    try:
        with show_progress(description, unit="rows", console=progress, transient=True) as shown:
            for batch in batches:
                if isinstance(batch, Uncounted):  # every rank runs what the others run (lockstep)
                    model(batch.batch)
                    if vectors is not None:
                        vectors(batch.batch)
                    continue
                before = rows.rows
                logits = model(batch)["logits"]
                evaluation.update(batch, logits, vectors(batch) if vectors is not None else None)
                if on_logits is not None:
                    on_logits(logits)
                shown.advance(rows.rows - before)
    finally:
        model.train(was_training)
    return evaluation


def evaluate(model: torch.nn.Module, reader, *, progress=None, description: str = "evaluate",
             on_logits=None, group_by: str | None = None, item_by: str | None = None) -> dict:
    """AUC and log loss of the model's predictions over one pass of `reader`, in bounded
    memory (`run_evaluation`); a multi-task model (logits [B, T]) gets them per task under
    "tasks", the first task's at the top level; GAUC with `group_by`, Recall@K / NDCG@K with `item_by`."""
    return run_evaluation(model, reader, progress=progress, description=description, on_logits=on_logits,
                          group_by=group_by, item_by=item_by).result()
