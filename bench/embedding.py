"""Sparse embeddings: key index speed, bytes per row, and DLRM step time by embedding kind.

1. EmbeddingVariable key index (deeprec/csrc/key_index.cpp), one core: an EV (dim 16, Adagrad) inserting
   1M new keys and looking up 1M existing keys (uniform and Zipf queries), each against a binary
   search over the same sorted keys + a gather (targets: lookup >= 2x, insert >= 1x); bytes per row.
2. DLRM (26 tables x dim 16, batch 512, 2 threads, Adagrad lr 0.01), pre-staged batches
   (preprocessing excluded), at 10k rows per table and at Criteo-Kaggle cardinalities:
      dense        nn.Embedding per table, dense gradients, torch.optim.Adagrad
      sparse       nn.Embedding(sparse=True), torch.optim.Adagrad
      deeprec      EmbeddingCollection: fused lookup, row-sparse Adagrad fused in backward
      torchrec     TorchRec's FusedEmbeddingBagCollection, FBGEMM's fused exact Adagrad
                   (an optional extra: pip install fbgemm-gpu-cpu==1.8.0 torchrec==1.9.2 --no-deps)
3. The embedding layer alone: 26 per-table EmbeddingBag(sparse=True) + torch Adagrad
   vs one EmbeddingCollection call with its fused update.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import numpy as np
import torch

import deeprec as dr
from _common import cpu_line, save_figure, print_table, save_json, summarize, synthetic_criteo
from deeprec import optim
from deeprec.data import KAGGLE_CARDINALITIES, CriteoReader
from deeprec.models import build_model
from deeprec.nn import EmbeddingCollection, EmbeddingFeature, EmbeddingVariable
from deeprec.ops.step import dot_interaction


def _median_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def bench_key_index(n: int, repeats: int = 9) -> dict:
    """One core: an EmbeddingVariable (dim 16, Adagrad slots) inserting n new keys and looking up n
    existing keys (in training: counted; in evaluation), against a binary search over the same
    sorted keys followed by a gather of their rows (torch.searchsorted + index_select)."""
    threads = torch.get_num_threads()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    keys = torch.unique(torch.randint(0, 2**62, (int(n * 1.05),), generator=g))[:n]
    keys = keys[torch.randperm(n, generator=g)]  # inserted in random order
    queries = {"uniform": keys[torch.randperm(n, generator=g)],  # every key once, shuffled
               "zipf": keys[torch.from_numpy(np.minimum(np.random.default_rng(0).zipf(1.2, n) - 1, n - 1))]}

    def fresh_variable():
        ev = EmbeddingVariable(16)
        ev.attach_slots({"accumulator": (0.1, True)})
        return ev

    inserts = []
    for _ in range(3):
        ev = fresh_variable()
        t = time.perf_counter()
        ev.lookup(keys, train=True)  # every key new: index inserts, table growth, initial values, gather
        inserts.append((time.perf_counter() - t) * 1e3)
    sorted_keys, weight = torch.sort(keys).values, torch.randn(n, 16)
    out = {"keys": n, "dim": 16, "insert_ms": statistics.median(inserts)}
    for name, q in queries.items():
        runs = {"binary_search_gather": lambda: weight.index_select(0, torch.searchsorted(sorted_keys, q)),
                "ev_lookup_train": lambda: ev.lookup(q, train=True), "ev_lookup_eval": lambda: ev.lookup(q, train=False)}
        times = {k: [] for k in runs}
        for _ in range(repeats):  # interleaved: a busy machine slows all of them alike
            for k, run in runs.items():
                times[k].append(_median_ms(run, 1))
        for k, ms in times.items():
            out[f"{k}_ms_{name}"] = statistics.median(ms)
        out[f"lookup_vs_binary_search_{name}"] = statistics.median(
            b / e for b, e in zip(times["binary_search_gather"], times["ev_lookup_train"]))
    base = out["binary_search_gather_ms_uniform"]
    out["lookup_vs_binary_search"] = out["lookup_vs_binary_search_uniform"]
    out["insert_vs_binary_search"] = base / out["insert_ms"]
    out["bytes_per_row_dim16_adagrad"] = ev.bytes_per_row()
    os.sched_setaffinity(0, set(range(os.cpu_count())))
    torch.set_num_threads(threads)
    return out


def staged_batches(path: str, n: int, sizes, embedding: str):
    model = build_model("dlrm", hash_buckets=sizes, embedding=embedding)
    fast = dr.optimize(model, dr.Config(smart_stage=True))
    reader = iter(CriteoReader(path, 512, num_epochs=None, drop_remainder=True))
    return [fast.stage(next(reader)) for _ in range(n)]


def dlrm_variant(kind: str, sizes):
    torch.manual_seed(0)
    if kind == "torchrec":
        return torchrec_dlrm(sizes)
    embedding = {"dense": "torch", "sparse": "torch", "deeprec": "table"}[kind]
    model = build_model("dlrm", hash_buckets=sizes, embedding=embedding, sparse_grad=kind == "sparse")
    fast = dr.optimize(model, dr.Config(smart_stage=True))
    opt = optim.make_optimizer(model, "adagrad", 0.01)
    return fast, opt


class TorchRecDLRM(torch.nn.Module):
    """Our DLRM's MLPs and interaction around TorchRec's FusedEmbeddingBagCollection."""

    def __init__(self, sizes):
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

        super().__init__()
        self.dlrm = build_model("dlrm", hash_buckets=sizes, embedding="torch")
        sizes = [self.dlrm.embeddings.buckets[k] for k in self.dlrm.embeddings.categorical]
        self.dlrm.embeddings = torch.nn.ModuleList()  # tables live in TorchRec
        self.keys = [f"C{i}" for i in range(1, 27)]
        tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=n, feature_names=[k])
                  for i, (k, n) in enumerate(zip(self.keys, sizes))]
        self.ebc = FusedEmbeddingBagCollection(tables, optimizer_type=torch.optim.Adagrad,
                                               optimizer_kwargs={"lr": 0.01})

    def forward(self, inputs):
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        dense, ids, label = inputs
        kjt = KeyedJaggedTensor(keys=self.keys, values=torch.cat(ids),
                                lengths=torch.ones(len(ids) * len(label), dtype=torch.int32))
        emb = self.ebc(kjt).values().view(len(label), len(ids), 16)
        d = self.dlrm
        bottom = d.bottom(dense)
        v = torch.cat([bottom.unsqueeze(1), emb], dim=1)
        dots = dot_interaction(v)  # our DLRM's interaction
        logits = d.top(torch.cat([bottom, dots], dim=1)).squeeze(1)
        return {"loss": torch.nn.functional.binary_cross_entropy_with_logits(logits, label)}


def torchrec_dlrm(sizes):
    model = TorchRecDLRM(sizes)
    dense_opt = torch.optim.Adagrad(model.dlrm.parameters(), lr=0.01)
    return model, optim.OptimizerGroup([dense_opt])


def torchrec_inputs(path: str, n: int, sizes):
    reader = iter(CriteoReader(path, 512, num_epochs=None, drop_remainder=True))
    features = build_model("dlrm", hash_buckets=sizes, embedding="torch").embeddings
    out = []
    for _ in range(n):
        batch = next(reader)
        ids = features.ids(batch)
        out.append((features.dense_values(batch), [ids[c] for c in features.categorical], batch["label"]))
    return out


def time_steps(fast, opt, staged, steps: int) -> list[float]:
    out = []
    for i in range(steps):
        t = time.perf_counter()
        result = fast(staged[i % len(staged)])
        result["loss"].backward()
        opt.step()
        opt.zero_grad()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def bench_dlrm(path, sizes, kinds, steps, warmup) -> dict:
    results = {}
    for kind in kinds:
        try:
            fast, opt = dlrm_variant(kind, sizes)
        except ImportError as err:
            results[kind] = {"skipped": f"torchrec not installed ({err})"}
            continue
        if kind == "torchrec":
            batches = torchrec_inputs(path, 20, sizes)
        else:
            batches = staged_batches(path, 20, sizes, "table" if kind == "deeprec" else "torch")
        time_steps(fast, opt, batches, warmup)
        results[kind] = summarize(time_steps(fast, opt, batches, steps))
        del fast, opt, batches
        gc.collect()
    return results


def bench_layer(steps: int) -> dict:
    """The embedding layer alone: fwd + bwd + update, 26 x 10k x 16, batch 512."""
    torch.manual_seed(0)
    ids = [torch.randint(0, 10_000, (512,)) for _ in range(26)]
    bags = [torch.nn.EmbeddingBag(10_000, 16, mode="sum", sparse=True) for _ in range(26)]
    torch_opt = torch.optim.Adagrad([p for b in bags for p in b.parameters()], lr=0.01)
    coll = EmbeddingCollection([EmbeddingFeature(f"C{i}", 10_000) for i in range(26)], 16)
    coll.set_optimizer(optim.Adagrad(lr=0.01))
    prepared = dr.nn.prepare_bags(ids, ("sum",) * 26, (None,) * 26)

    def per_table():
        out = torch.stack([b(i.unsqueeze(1)) for b, i in zip(bags, ids)], dim=1)
        out.sum().backward()
        torch_opt.step()
        torch_opt.zero_grad()

    def fused():
        coll.lookup(*prepared).sum().backward()

    def fused_with_prepare():
        coll({f"C{i}": x for i, x in enumerate(ids)}).sum().backward()

    res = {}
    for name, fn in (("per-table EmbeddingBag", per_table), ("EmbeddingCollection", fused),
                     ("EmbeddingCollection incl. dedup", fused_with_prepare)):
        for _ in range(5):
            fn()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        res[name] = summarize(times)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--key-index-only", action="store_true", help="the key index section alone")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kaggle-dense-steps", type=int, default=3)
    parser.add_argument("--skip-kaggle", action="store_true")
    args = parser.parse_args()
    path = synthetic_criteo(200_000)

    index = bench_key_index(args.keys)
    bs = "binary search + gather"
    print_table(f"EmbeddingVariable key index, one core, {index['keys']:,} keys, dim 16 ({cpu_line()})",
                ["operation", "ms", f"{bs}, ms", "speed vs it"],
                [["insert (all keys new)", f"{index['insert_ms']:.1f}", f"{index['binary_search_gather_ms_uniform']:.1f}",
                  f"{index['insert_vs_binary_search']:.2f}x"]]
                + [[f"lookup existing, {q}, {mode}", f"{index[f'ev_lookup_{mode}_ms_{q}']:.1f}",
                    f"{index[f'binary_search_gather_ms_{q}']:.1f}",
                    f"{index[f'binary_search_gather_ms_{q}'] / index[f'ev_lookup_{mode}_ms_{q}']:.2f}x"]
                   for q in ("uniform", "zipf") for mode in ("train", "eval")])
    print(f"bytes/row (dim 16, Adagrad): {index['bytes_per_row_dim16_adagrad']:.0f}")
    if args.key_index_only:
        print("saved", save_json("embedding_key_index", {"key_index": index}))
        return

    layer = bench_layer(args.steps)
    base = layer["per-table EmbeddingBag"]["median"]
    print_table("embedding layer alone: fwd + bwd + Adagrad update (26 x 10k x 16, batch 512)",
                ["variant", "ms", "p10-p90", "speed-up"],
                [[k, f"{v['median']:.2f}", f"{v['p10']:.2f}-{v['p90']:.2f}", f"{base / v['median']:.1f}x"]
                 for k, v in layer.items()])

    kinds = ["dense", "sparse", "deeprec", "torchrec"]
    sizes = {"10k": 10_000}
    if not args.skip_kaggle:
        sizes["kaggle"] = KAGGLE_CARDINALITIES
    dlrm = {}
    for label, size in sizes.items():
        steps = args.steps
        res = {}
        for kind in kinds:
            n = args.kaggle_dense_steps if (label == "kaggle" and kind == "dense") else steps
            res.update(bench_dlrm(path, size, [kind], n, warmup=1 if n < 5 else 3))
        dlrm[label] = res
    rows = []
    for label, res in dlrm.items():
        ours = res["deeprec"]["median"]
        for kind, r in res.items():
            if "skipped" in r:
                rows.append([label, kind, "skipped", "", r["skipped"][:60]])
                continue
            rows.append([label, kind, f"{r['median']:.1f}", f"{r['p10']:.1f}-{r['p90']:.1f}",
                         f"{r['median'] / ours:.2f}x"])
    print_table("DLRM step, batch 512, Adagrad, 2 threads (ms; last column: variant / deeprec)",
                ["tables", "variant", "ms/step", "p10-p90", "vs deeprec"], rows)
    print("saved", save_json("embedding", {"key_index": index, "layer": layer, "dlrm": dlrm}))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(dlrm), figsize=(5 * len(dlrm), 3))
    for ax, (label, res) in zip(np.atleast_1d(axes), dlrm.items()):
        names = [k for k, r in res.items() if "skipped" not in r]
        ax.bar(names, [res[k]["median"] for k in names], color="#66c2a5")
        ax.set_yscale("log")
        ax.set_title(f"DLRM step, {label} rows/table")
        ax.set_ylabel("ms (median, log scale)")
    save_figure(fig, "embedding")


if __name__ == "__main__":
    main()
