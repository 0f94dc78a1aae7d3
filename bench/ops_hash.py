"""Hashing a batch of raw categorical strings: 512 rows x 26 Criteo columns, one core.

Budget from the foundation issue: <= 2 ms. Measured side by side in one run:
  bytes  - numpy object arrays of bytes, as CriteoReader yields them (the model's path)
  str    - the same values as Python str (encoded to UTF-8 inside the hash)
Each repetition hashes all 26 columns with `deeprec.ops.string_to_hash_bucket`.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from _common import plot_path, save_figure, print_table, save_json, summarize
from deeprec import ops
from deeprec.data import CriteoReader, write_synthetic

BUDGET_MS = 2.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=500)
    args = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    torch.set_num_threads(1)

    path = os.path.join(os.path.dirname(plot_path("x")), "hash_input.tsv")
    write_synthetic(path, args.batch_size * 8, cardinalities="kaggle", seed=11)
    batch = next(iter(CriteoReader(path, args.batch_size)))
    os.unlink(path)
    columns = {"bytes": [batch[f"C{i}"] for i in range(1, 27)]}
    columns["str"] = [np.array([v.decode() for v in col], dtype=object) for col in columns["bytes"]]

    timings = {name: [] for name in columns}
    for _ in range(args.repeats):  # interleave the variants so drift hits both alike
        for name, cols in columns.items():
            start = time.perf_counter()
            for col in cols:
                ops.string_to_hash_bucket(col, 10000)
            timings[name].append((time.perf_counter() - start) * 1e3)
    stats = {name: summarize(t) for name, t in timings.items()}
    rows = [[name, f"{s['median']:.3f}", f"{s['p10']:.3f}-{s['p90']:.3f}",
             "yes" if s["median"] <= BUDGET_MS else "NO"] for name, s in stats.items()]
    print_table(f"hash {args.batch_size} x 26 strings, 1 core (ms)", ["input", "median", "p10-p90", "<= 2 ms"], rows)
    print("saved", save_json("ops_hash", {"batch_size": args.batch_size, "columns": 26, "budget_ms": BUDGET_MS,
                                          "ms": stats}))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.boxplot([timings[n] for n in columns], tick_labels=list(columns), showfliers=False)
    ax.axhline(BUDGET_MS, color="red", linestyle="--", label="budget 2 ms")
    ax.set_ylabel("ms per 512 x 26 strings")
    ax.legend()
    save_figure(fig, "ops_hash")


if __name__ == "__main__":
    main()
