"""GAUC and Recall@K / NDCG@K: exact against scikit-learn and a brute-force ranking, in bounded
memory, across ranks, and from the trainer and `deeprec evaluate` on the behaviour data."""
import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from deeprec.data import open_reader, resolve_schema
from deeprec.metrics import GroupedAUC, RetrievalMetrics, evaluate, ranking_columns
from deeprec.trainer import TrainConfig, Trainer


def per_user_gauc(groups, labels, scores) -> float:
    """The DIN paper's definition, user by user, with scikit-learn's AUC."""
    num = den = 0.0
    for user in np.unique(groups):
        mine = groups == user
        if labels[mine].all() or not labels[mine].any():
            continue
        num += mine.sum() * roc_auc_score(labels[mine], scores[mine])
        den += mine.sum()
    return num / den


def rows(n=20_000, users=400, seed=0):
    rng = np.random.default_rng(seed)
    groups = rng.integers(0, users, n) * 7919 - 10**12  # negative and sparse keys work too
    labels = rng.random(n) < 0.3
    scores = np.round(rng.normal(size=n) + 0.7 * labels, 1).astype(np.float32)  # many ties
    return groups, labels, scores


def test_gauc_equals_per_user_auc_weighted_by_impressions():
    groups, labels, scores = rows()
    gauc = GroupedAUC()
    for start in range(0, len(groups), 3001):
        part = slice(start, start + 3001)
        gauc.update(groups[part], labels[part].astype(np.float32), scores[part])
    result = gauc.result()
    assert result["gauc"] == pytest.approx(per_user_gauc(groups, labels, scores), abs=1e-12)
    both = [u for u in np.unique(groups) if 0 < labels[groups == u].sum() < (groups == u).sum()]
    assert result["gauc_users"] == len(both) and "gauc_sampled" not in result


def test_gauc_in_bounded_memory_keeps_whole_users_and_says_so():
    groups, labels, scores = rows(n=40_000, users=2000, seed=1)
    gauc = GroupedAUC(max_rows=6000)
    for start in range(0, len(groups), 1000):
        part = slice(start, start + 1000)
        gauc.update(groups[part], labels[part], scores[part])
        assert gauc.rows <= 6000
    result = gauc.result()
    kept = np.unique(gauc.arrays()[0])
    assert result["gauc_sampled"] == 1 / 8 and 0.05 < len(kept) / 2000 < 0.2  # a 1/8 sample of the users
    whole = np.isin(groups, kept)
    assert whole.sum() == gauc.rows  # every row of a kept user, none of the others
    assert result["gauc"] == pytest.approx(per_user_gauc(groups[whole], labels[whole], scores[whole]), abs=1e-12)


def test_gauc_of_two_shards_merged_equals_one_pass():
    groups, labels, scores = rows(seed=2)
    one, a, b = GroupedAUC(), GroupedAUC(), GroupedAUC()
    one.update(groups, labels, scores)
    a.update(groups[::2], labels[::2], scores[::2])  # a user's rows on both "ranks"
    b.update(groups[1::2], labels[1::2], scores[1::2])
    a.merge(b)
    assert a.result() == one.result()


def test_gauc_of_merged_shards_stays_bounded_and_equals_one_bounded_pass():
    groups, labels, scores = rows(seed=3)
    limit = len(groups) // 3  # the union of the shards (each sampled already) is past it
    one, a, b = GroupedAUC(limit), GroupedAUC(limit), GroupedAUC(limit)
    one.update(groups, labels, scores)
    a.update(groups[::2], labels[::2], scores[::2])
    b.update(groups[1::2], labels[1::2], scores[1::2])
    a.merge(b)
    assert a.rows <= limit and a.level == one.level > 0
    assert a.result() == one.result()


def brute_force_retrieval(batches, ks, candidates):
    """The documented definition, one query at a time over an ordered pool."""
    pool: dict[int, np.ndarray] = {}
    hits, dcg, queries = np.zeros(len(ks)), np.zeros(len(ks)), 0
    def refresh(items, item):
        for i in range(len(items)):  # the batch's items become the newest, last row's vector wins
            pool.pop(int(items[i]), None)
            pool[int(items[i])] = item[i]
        while len(pool) > candidates:
            pool.pop(next(iter(pool)))

    for items, labels, user, item in batches:
        filling = len(pool) < candidates
        if filling:
            refresh(items, item)
        if len(pool) >= candidates:
            for i in np.flatnonzero(labels):
                own = float(user[i] @ item[i])
                rank = 1 + sum(float(user[i] @ v) > own for key, v in pool.items() if key != items[i])
                for j, k in enumerate(ks):
                    hits[j] += rank <= k
                    dcg[j] += (rank <= k) / np.log2(1 + rank)
                queries += 1
        if not filling:
            refresh(items, item)
    return queries, hits / queries, dcg / queries


def test_recall_and_ndcg_equal_a_brute_force_ranking():
    rng = np.random.default_rng(3)
    batches = []
    for _ in range(12):
        items = rng.integers(0, 300, 64)
        item = np.stack([np.sin(np.arange(8) * (k + 1) * 0.37) for k in items]).astype(np.float32)
        user = (item + rng.normal(scale=1.0, size=item.shape)).astype(np.float32)  # near its own item
        batches.append((items, rng.random(64) < 0.5, user, item))
    metrics = RetrievalMetrics(ks=(1, 5, 20), candidates=50)
    for items, labels, user, item in batches:
        metrics.update(items, labels, torch.from_numpy(user), torch.from_numpy(item))
    result = metrics.result()
    queries, recall, ndcg = brute_force_retrieval(batches, (1, 5, 20), 50)
    assert result["retrieval_queries"] == queries > 0
    assert [result["recall@1"], result["recall@5"], result["recall@20"]] == pytest.approx(list(recall), abs=1e-12)
    assert [result["ndcg@1"], result["ndcg@5"], result["ndcg@20"]] == pytest.approx(list(ndcg), abs=1e-12)
    assert 0 < result["recall@1"] < result["recall@5"] < result["recall@20"] < 1


@pytest.mark.slow
def test_din_evaluation_reports_gauc_of_its_predictions(behavior):
    train, held_out = behavior
    cfg = TrainConfig.create(model="din", data=[train], eval_data=[held_out], steps=30, batch_size=256,
                             progress=False, model_overrides={"hash_buckets": 20000})
    trainer = Trainer(cfg)
    result = trainer.train()
    assert ranking_columns(trainer.schema)["group_by"] == "user_id"
    logits = []
    reader = open_reader([held_out], 1000, schema=trainer.schema, num_epochs=1)
    again = evaluate(trainer.model, reader, on_logits=logits.append, **ranking_columns(trainer.schema))
    users, labels = [], []
    for batch in open_reader([held_out], 1000, schema=trainer.schema, num_epochs=1):
        users.append(batch["user_id"].numpy())
        labels.append(batch["click"].numpy())
    scores = torch.cat(logits).float().numpy()
    expected = per_user_gauc(np.concatenate(users), np.concatenate(labels) > 0.5, scores)
    assert result["eval"]["gauc"] == again["gauc"] == pytest.approx(expected, abs=1e-9)
    assert result["eval"]["gauc_users"] > 100


def test_dssm_evaluation_ranks_items_and_criteo_has_no_ranking_metrics(behavior, sample):
    train, held_out = behavior
    cfg = TrainConfig.create(model="dssm", data=[train], eval_data=[held_out], steps=150, batch_size=256,
                             optimizer="adam", lr=0.003, progress=False, model_overrides={"hash_buckets": 20000})
    ev = Trainer(cfg).train()["eval"]
    assert ev["retrieval_queries"] > 1000 and ev["retrieval_candidates"] == 100
    assert 0 <= ev["ndcg@5"] <= ev["recall@5"] <= ev["recall@10"] <= 1
    assert "gauc" in ev  # behaviour data names its user column
    assert ranking_columns(resolve_schema([sample], None)) == {"group_by": None, "item_by": None}
