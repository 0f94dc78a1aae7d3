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

An EV's initial rows do not depend on the training seed (DeepRec's InitializerOption: row key % 4096
of a matrix drawn with its own seed 0), so its seed spread is the DNN's init only; the tables' and
DeepCTR-Torch's rows are drawn from the seed. "single folds" is the range of one fold's AUC over all
seeds and folds: the noise of a 20-40 row held-out set.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from _common import cpu_line, print_table, save_figure, save_json
from quality import DIFFERENCES, deeprec_run
from quality_peers import DeepCTRPeer, encode, train_peer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(ROOT, "deeprec", "data", "samples")
DATASETS = {"movielens": "movielens_sample.txt", "avazu": "avazu_sample.txt", "criteo": "criteo_sample.txt"}
IMPLS = ("deeprec --embedding variable", "deeprec --embedding table", "DeepCTR-Torch 0.3.0 DeepFM")
SIZES = "emb 16, DNN 1024-256-32; table and DeepCTR-Torch: 10k buckets/column"


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


def run_fold(impl: str, train: str, held_out: str, *, seed: int, args) -> dict:
    rows = len(encode("deepfm", train)["label"])
    per_epoch = math.ceil(rows / args.batch_size)
    opt = dict(steps=args.epochs * per_epoch, batch=args.batch_size, optimizer="adam", lr=args.lr,
               eval_every=per_epoch)
    if impl.startswith("deeprec"):
        kind = impl.rsplit(" ", 1)[1]
        return deeprec_run("deepfm", train, held_out, seed=seed, overrides={"embedding": kind}, **opt)
    data, evald = encode("deepfm", train), encode("deepfm", held_out)
    return train_peer(DeepCTRPeer("deepfm", data, 16, (1024, 256, 32), seed=seed), data, evald, **opt)


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def plot(results: list[dict], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), squeeze=False)
    for ax, r in zip(axes[0], results):
        for x, impl in enumerate(IMPLS):
            s = r["summary"][impl]
            ax.bar(x, s["mean"], color=f"C{x}", alpha=0.6,
                   yerr=[[s["mean"] - s["min"]], [s["max"] - s["mean"]]], capsize=4)
            ax.scatter([x] * len(r["seeds"]), [r["auc"][impl][str(seed)] for seed in r["seeds"]], color="k", s=8)
        ax.set_xticks(range(len(IMPLS)), ["variable", "table", "DeepCTR"])
        values = [v for impl in IMPLS for v in r["auc"][impl].values()]
        ax.set_ylim(min(values) - 0.03, max(values) + 0.03)
        ax.set_title(f"DeepFM, {r['dataset']} ({r['rows']} rows, {r['folds']}-fold)", fontsize=9)
        ax.set_ylabel("mean held-out AUC (bar: seeds' mean, min-max)")
    save_figure(fig, name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", default="movielens,avazu,criteo")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (runs are sequential)")
    p.add_argument("--out", default="quality_embedding", help="results/<out>.json and .png")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    seeds = list(range(args.seeds))
    workdir = tempfile.mkdtemp(prefix="deeprec-quality-embedding-")
    started = time.perf_counter()
    results = []
    try:
        for dataset in [d for d in args.datasets.split(",") if d]:
            path = os.path.join(SAMPLES, DATASETS[dataset])
            folds = folds_of(path, args.folds, workdir)
            auc: dict[str, dict[str, float]] = {impl: {} for impl in IMPLS}
            runs: dict[str, list] = {impl: [] for impl in IMPLS}
            for impl in IMPLS:
                for seed in seeds:
                    fold_runs = []
                    for f_, (train, held_out) in enumerate(folds):
                        print(f"[{dataset}] {impl}, seed {seed}, fold {f_}", flush=True)
                        run = run_fold(impl, train, held_out, seed=seed, args=args)
                        fold_runs.append({"fold": f_, "eval": run["eval"], "eval_history": run["eval_history"],
                                          "final_loss": run["final_loss"], "seconds": run["seconds"]})
                    auc[impl][str(seed)] = statistics.fmean(r["eval"]["auc"] for r in fold_runs)
                    runs[impl].append({"seed": seed, "folds": fold_runs})
            labels = encode("deepfm", path)["label"]
            fold_auc = {impl: [f["eval"]["auc"] for run in runs[impl] for f in run["folds"]] for impl in IMPLS}
            results.append({"dataset": dataset, "file": os.path.relpath(path, ROOT), "rows": len(labels),
                            "positives": int(labels.sum()), "folds": args.folds, "seeds": seeds,
                            "collisions": collisions(path), "auc": auc,
                            "summary": {impl: spread(list(auc[impl].values())) for impl in IMPLS},
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
                         "{min:.2f}-{max:.2f}".format(**r["fold_auc"][impl]),
                         "" if impl == IMPLS[0] else f"{s['mean'] - base:+.4f}",
                         f"{hit}/{keys}" if impl != IMPLS[0] else f"0/{keys}"])
    print_table(f"DeepFM, {args.epochs} epochs, {len(seeds)} seeds, {args.folds}-fold mean held-out AUC, "
                f"Adam lr {args.lr}, batch {args.batch_size} ({cpu_line()})",
                ["data", "rows", "implementation", "AUC mean", "std (seeds)", "min-max (seeds)", "single folds",
                 "vs variable",
                 "colliding keys"], rows)
    payload = {"config": {**vars(args), "sizes": SIZES, "seconds": time.perf_counter() - started},
               "cpu": cpu_line(), "method": __doc__, "differences": DIFFERENCES["DeepCTR-Torch 0.3.0 DeepFM"],
               "table": rows, "results": results}
    print("saved", save_json(args.out, payload))
    plot(results, args.out)


if __name__ == "__main__":
    sys.exit(main())
