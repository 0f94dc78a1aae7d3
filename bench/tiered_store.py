"""Disk tier candidates for multi-tier EmbeddingVariable storage (issue 16), side by side:
LMDB (a well-kept embedded B-tree store, `lmdb` binding) vs a memory-mapped row arena
(fixed-size rows in one file, a free list for reuse, numpy fancy indexing).

Each step reads the rows of ~13k random keys (a DLRM batch's misses, 26 tables x 512 ids)
in one batched call and writes back as many (evicted rows with their Adagrad slot:
32 float32 = 128 bytes a row). Rows: 1M (128 MB, so the page cache holds it: this measures
the CPU cost of each store's batched access, not the disk). Medians of interleaved rounds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from _common import cpu_line, print_table, save_figure, save_json

ROW_FLOATS = 32


def build_lmdb(path: str, rows: np.ndarray):
    import lmdb

    env = lmdb.open(path, map_size=4 << 30, writemap=True, sync=False, metasync=False, lock=False)
    with env.begin(write=True) as txn, txn.cursor() as cursor:
        cursor.putmulti(zip(_keys(np.arange(len(rows))), (r.tobytes() for r in rows)), append=True)
    return env


def _keys(ids: np.ndarray) -> list[bytes]:
    """8-byte big-endian keys: LMDB's byte order is then the ids' order."""
    raw = ids.astype(">u8").tobytes()
    return [raw[i:i + 8] for i in range(0, len(raw), 8)]


def lmdb_read(env, ids: np.ndarray) -> np.ndarray:
    keys = _keys(np.sort(ids))
    with env.begin(buffers=False) as txn, txn.cursor() as cursor:
        found = cursor.getmulti(keys)
    return np.frombuffer(b"".join(v for _, v in found), dtype=np.float32).reshape(-1, ROW_FLOATS)


def lmdb_write(env, ids: np.ndarray, values: np.ndarray) -> None:
    order = np.argsort(ids)
    with env.begin(write=True) as txn, txn.cursor() as cursor:
        cursor.putmulti(zip(_keys(ids[order]), (v.tobytes() for v in values[order])))


def build_arena(path: str, rows: np.ndarray) -> np.memmap:
    arena = np.memmap(path, dtype=np.float32, mode="w+", shape=rows.shape)
    arena[:] = rows
    arena.flush()
    return arena


def arena_read(arena: np.memmap, slots: np.ndarray) -> np.ndarray:
    return arena[np.sort(slots)]  # one gather; sorted slots touch pages in order


def arena_write(arena: np.memmap, slots: np.ndarray, values: np.ndarray) -> None:
    order = np.argsort(slots)
    arena[slots[order]] = values[order]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=13_000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((args.rows, ROW_FLOATS), dtype=np.float32)
    with tempfile.TemporaryDirectory(dir=os.environ.get("DEEPREC_CACHE")) as folder:
        start = time.perf_counter()
        env = build_lmdb(os.path.join(folder, "lmdb"), rows)
        build = {"lmdb": time.perf_counter() - start}
        start = time.perf_counter()
        arena = build_arena(os.path.join(folder, "arena.bin"), rows)
        build["mmap arena"] = time.perf_counter() - start
        times = {k: {"read": [], "write": []} for k in build}
        for _ in range(args.rounds):
            ids = rng.choice(args.rows, args.batch, replace=False)
            values = rng.standard_normal((args.batch, ROW_FLOATS), dtype=np.float32)
            for name, read, write in (("lmdb", lambda: lmdb_read(env, ids), lambda: lmdb_write(env, ids, values)),
                                      ("mmap arena", lambda: arena_read(arena, ids),
                                       lambda: arena_write(arena, ids, values))):
                t = time.perf_counter()
                got = read()
                times[name]["read"].append((time.perf_counter() - t) * 1e3)
                assert got.shape == (args.batch, ROW_FLOATS)
                t = time.perf_counter()
                write()
                times[name]["write"].append((time.perf_counter() - t) * 1e3)
        check = np.sort(rng.choice(args.rows, 100, replace=False))
        assert np.array_equal(lmdb_read(env, check), arena_read(arena, check))  # both stores hold the same rows
        env.close()
    results = {name: {op: statistics.median(v) for op, v in t.items()} | {"build_s": build[name]}
               for name, t in times.items()}
    table = [[name, f"{r['read']:.2f}", f"{r['write']:.2f}", f"{r['build_s']:.1f}"] for name, r in results.items()]
    print_table(f"disk tier candidates: batched access to {args.batch:,} random rows of {args.rows:,} "
                f"(128 B each, page cache warm) - {cpu_line()}", ["store", "read ms", "write ms", "build s"], table)
    print("saved", save_json("tiered_store", {"rows": args.rows, "batch": args.batch, "rounds": args.rounds,
                                              "results": results}))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    names = list(results)
    ax.bar([i - 0.2 for i in range(len(names))], [results[n]["read"] for n in names], 0.4, label="read")
    ax.bar([i + 0.2 for i in range(len(names))], [results[n]["write"] for n in names], 0.4, label="write")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(f"ms per batch of {args.batch:,} rows")
    ax.legend()
    save_figure(fig, "tiered_store")


if __name__ == "__main__":
    main()
