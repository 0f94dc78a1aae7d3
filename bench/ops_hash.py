"""Hashing a batch of raw categorical strings: 512 rows x 26 Criteo columns, one core.

Each variant starts from the parsed Arrow columns (what pyarrow's CSV reader gives the
reader) and ends with int64 bucket ids, so it measures the whole path. Side by side:

  before (deeprec 0.1)  Arrow -> numpy object arrays of bytes (what batches held) -> pandas'
                        SipHash kernel + splitmix64 + modulo in numpy, one column at a time
  native, per column    Arrow -> Ragged (zero-copy) -> torch.ops.deeprec, 26 calls
  native, one call      the same, all 26 columns in one op call (what the model zoo does)
  native farmhash       one call, hash="farmhash" (TensorFlow's to_hash_bucket_fast)

and the hashing op alone, its input already in a batch (the conversion is then the reader's):

  op only, before       pandas' SipHash over the numpy object arrays
  op only, native       one torch.ops.deeprec call over the 26 Raggeds (siphash / farmhash)

The issue's target: the native path >= 10x faster than before. Budget: <= 2 ms.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import pyarrow.csv as pacsv
import torch

from _common import cpu_line, plot_path, print_table, save_figure, save_json, summarize
from deeprec import Ragged, ops
from deeprec.data import CRITEO_SCHEMA, write_synthetic

BUDGET_MS = 2.0


def before(columns, buckets: int, converted: bool = False):
    """deeprec 0.1's path, kept here as the baseline: pandas' SipHash over Python bytes objects
    (`converted`: the columns are numpy object arrays already)."""
    from pandas._libs.hashing import hash_object_array

    out = []
    for col in columns:
        values = col if converted else np.asarray(col.to_numpy(zero_copy_only=False), dtype=object)
        with np.errstate(over="ignore"):
            x = hash_object_array(values, "0123456789123456", "utf8")
            x ^= x >> np.uint64(30)
            x *= np.uint64(0xBF58476D1CE4E5B9)
            x ^= x >> np.uint64(27)
            x *= np.uint64(0x94D049BB133111EB)
            x ^= x >> np.uint64(31)
        out.append(torch.from_numpy((x % np.uint64(buckets)).view(np.int64)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=400)
    args = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    torch.set_num_threads(1)

    path = os.path.join(os.path.dirname(plot_path("x")), "hash_input.tsv")
    write_synthetic(path, args.batch_size, cardinalities="kaggle", seed=11)
    names = [f"C{i}" for i in range(1, 27)]
    table = pacsv.read_csv(path, read_options=pacsv.ReadOptions(column_names=list(CRITEO_SCHEMA.file_names)),
                           parse_options=pacsv.ParseOptions(delimiter="\t"),
                           convert_options=pacsv.ConvertOptions(column_types={n: "binary" for n in names}))
    os.unlink(path)
    columns = [table.column(n) for n in names]
    as_objects = [np.asarray(c.to_numpy(zero_copy_only=False), dtype=object) for c in columns]
    as_ragged = [Ragged.from_arrow(c) for c in columns]
    variants = {
        "before (deeprec 0.1)": lambda: before(columns, 10000),
        "native, per column": lambda: [ops.string_to_hash_bucket(Ragged.from_arrow(c), 10000) for c in columns],
        "native, one call": lambda: ops.string_to_hash_bucket([Ragged.from_arrow(c) for c in columns], 10000),
        "native farmhash, one call": lambda: ops.string_to_hash_bucket([Ragged.from_arrow(c) for c in columns],
                                                                       10000, hash="farmhash"),
        "op only, before": lambda: before(as_objects, 10000, converted=True),
        "op only, native": lambda: ops.string_to_hash_bucket(as_ragged, 10000),
        "op only, native farmhash": lambda: ops.string_to_hash_bucket(as_ragged, 10000, hash="farmhash"),
    }
    reference = variants["before (deeprec 0.1)"]()
    for name in ("native, per column", "native, one call"):
        assert all(torch.equal(a, b) for a, b in zip(variants[name](), reference)), name  # same bucket ids

    timings = {name: [] for name in variants}
    for _ in range(args.repeats):  # interleaved so drift hits every variant alike
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            timings[name].append((time.perf_counter() - start) * 1e3)
    stats = {name: summarize(t) for name, t in timings.items()}
    def base_of(name):
        return stats["op only, before" if name.startswith("op only") else "before (deeprec 0.1)"]["median"]

    rows = [[name, f"{s['median']:.3f}", f"{s['p10']:.3f}-{s['p90']:.3f}", f"{base_of(name) / s['median']:.1f}x",
             "yes" if s["median"] <= BUDGET_MS else "NO"] for name, s in stats.items()]
    print_table(f"hash {args.batch_size} x 26 strings from Arrow to bucket ids, 1 core (ms) ({cpu_line()})",
                ["path", "median", "p10-p90", "vs before", "<= 2 ms"], rows)
    print("saved", save_json("ops_hash", {"batch_size": args.batch_size, "columns": 26, "budget_ms": BUDGET_MS,
                                          "ms": stats, "speedup_vs_before": {n: base_of(n) / s["median"]
                                                                             for n, s in stats.items()}}))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.2))
    ax.boxplot([timings[n] for n in variants], tick_labels=[n.replace(", ", "\n") for n in variants],
               showfliers=False)
    ax.axhline(BUDGET_MS, color="red", linestyle="--", label="budget 2 ms")
    ax.set_ylabel("ms per 512 x 26 strings")
    ax.legend()
    save_figure(fig, "ops_hash")


if __name__ == "__main__":
    main()
