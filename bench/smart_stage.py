"""SmartStage vs sequential vs a torch DataLoader, side by side, one run.

Workload: DLRM (DeepRec modelzoo sizes) whose forward also builds crossed
features: each of the 26 categorical features becomes a bag of its own hashed
id plus `--crosses` hashed crosses with the next features, deduplicated before
the lookup. Preprocessing (read, parse, hash, cross, dedup) is 30-50% of the
sequential step. Variants:

    sequential   read -> forward (preprocessing inside) -> backward -> update, all threads
    smartstage-thread   dr.optimize(smart_stage=True): stage in a background thread
                 (1 intra-op thread), step with cores - 1 intra-op threads
    smartstage-process  the same with SmartStageOptions(executor="process"): reader and
                 stage in one worker process, results through a pipe (no GIL sharing)
    smartstage-auto     SmartStageOptions(executor="auto") through fast.iterate(): it measures
                 the first batches and picks off, thread or process (timed after its calibration)
    dataloader   torch DataLoader, 1 worker process running the same stage function
                 in its dataset; step with cores - 1 intra-op threads

Also measured alone: stage (read + stage subgraph, one thread) and main (the
step on pre-staged batches, cores - 1 threads). efficiency = max(stage, main,
(stage + main) / cores) / pipelined step: 1.0 means perfect overlap.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

import deeprec as dr
from _common import cpu_line, print_table, save_figure, save_json, summarize, synthetic_criteo
from deeprec import ops
from deeprec.data import CriteoReader
from deeprec.data import CRITEO_SCHEMA, SPARSE as CRITEO_SPARSE
from deeprec.models.common import MLP
from deeprec.models.features import FeatureEmbedder
from deeprec.optim import make_optimizer
from deeprec.runtime import auto_stage

CORES = os.cpu_count() or 1


class CrossedDLRM(nn.Module):
    """DLRM whose categorical inputs are bags of hashed ids and hashed crosses."""

    def __init__(self, crosses: int = 3, buckets: int = 10000, dim: int = 16):
        super().__init__()
        self.crosses, self.buckets = crosses, buckets
        self.features = FeatureEmbedder(CRITEO_SCHEMA, dim, buckets, embedding="torch")  # its dense values and tables
        self.bottom = MLP(13, (512, 256, 64, dim))
        rows, cols = torch.tril_indices(27, 27, offset=-1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.top = MLP(dim + 351, (512, 256), out=1)

    def forward(self, batch):
        dense = self.bottom(self.features.dense_values(batch))
        vectors = [dense]
        for f, name in enumerate(CRITEO_SPARSE):
            bag = [ops.string_to_hash_bucket(batch[name], self.buckets)]
            bag += [ops.cross_hash_bucket([batch[name], batch[CRITEO_SPARSE[(f + j) % 26]]], self.buckets)
                    for j in range(1, self.crosses + 1)]
            unique, inverse = ops.dedup(torch.stack(bag, dim=1))
            vectors.append(nn.functional.embedding_bag(inverse, self.features.tables[name](unique), mode="sum"))
        v = torch.stack(vectors, dim=1)
        dots = torch.bmm(v, v.transpose(1, 2))[:, self.rows, self.cols]
        logits = self.top(torch.cat([dense, dots], dim=1)).squeeze(1)
        return {"loss": nn.functional.binary_cross_entropy_with_logits(logits, batch["label"]), "logits": logits}


class StagedDataset(torch.utils.data.IterableDataset):
    """The DataLoader variant: the worker reads and runs the same stage function."""

    def __init__(self, path, batch_size, stage):
        self.path, self.batch_size, self.stage = path, batch_size, stage

    def __iter__(self):
        torch.set_num_threads(1)
        for batch in CriteoReader(self.path, self.batch_size, num_epochs=None, drop_remainder=True):
            yield self.stage(batch)


def train_step(step_fn, opt):
    out = step_fn()
    out["loss"].backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--crosses", type=int, default=3)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=200_000)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = synthetic_criteo(args.rows)

    model = CrossedDLRM(args.crosses)
    opt = make_optimizer(model, args.optimizer, 1e-3)
    fast = dr.optimize(model, dr.Config(smart_stage=True, smart_stage_options=dr.SmartStageOptions(capacity=4)))
    fast_process = dr.optimize(model, dr.Config(
        smart_stage=True, smart_stage_options=dr.SmartStageOptions(capacity=4, executor="process")))
    fast_auto = dr.optimize(model, dr.Config(
        smart_stage=True, smart_stage_options=dr.SmartStageOptions(capacity=4, executor="auto")))
    main_threads = max(1, CORES - 1)
    full_threads = torch.get_num_threads()

    def reader():
        return CriteoReader(data, args.batch_size, num_epochs=None, drop_remainder=True)

    def timed_loop(batches, step, n):
        """Per-step wall ms of `n` steps over an iterator (warm-up of 3 steps first)."""
        for _ in range(3):
            step(next(batches))
        out = []
        for _ in range(n):
            t = time.perf_counter()
            step(next(batches))
            out.append((time.perf_counter() - t) * 1e3)
        return out

    def auto_loop(n):
        """Per-step wall ms through fast_auto.iterate(), after its calibration and trials."""
        warm = 2 * auto_stage.W + 2 * auto_stage.T + 3
        steps, out = fast_auto.iterate(reader(), backward=True), []
        for k in range(warm + n):
            t = time.perf_counter()
            next(steps)
            opt.step()
            opt.zero_grad()
            if k >= warm:
                out.append((time.perf_counter() - t) * 1e3)
        steps.close()
        return out

    pipelined = ("sequential", "smartstage-thread", "smartstage-process", "smartstage-auto", "dataloader")
    ms = {k: [] for k in pipelined + ("stage alone", "main alone", "main alone (all threads)")}
    rounds = {k: [] for k in pipelined}
    picked = []
    for _ in range(args.rounds):
        torch.set_num_threads(full_threads)
        seq = timed_loop(iter(reader()), lambda b: train_step(lambda: model(b), opt), args.steps)
        with torch.no_grad():
            torch.set_num_threads(1)
            src = iter(reader())
            stage_ms = timed_loop(src, lambda _: None, 0)  # warm
            staged, stage_ms = [], []
            for _ in range(args.steps):
                t = time.perf_counter()
                staged.append(fast.stage(next(src)))
                stage_ms.append((time.perf_counter() - t) * 1e3)
        torch.set_num_threads(main_threads)
        main_ms = timed_loop(iter(staged * 2), lambda s: train_step(lambda: fast(s), opt), args.steps - 3)
        torch.set_num_threads(full_threads)
        main_full = timed_loop(iter(staged * 2), lambda s: train_step(lambda: fast(s), opt), args.steps - 3)
        with dr.make_prefetch_hook(fast, reader()) as hook:  # sets cores - 1 threads for the step
            smart = timed_loop(iter(hook), lambda s: train_step(lambda: fast(s), opt), args.steps)
        with dr.make_prefetch_hook(fast_process, reader()) as hook:
            smart_process = timed_loop(iter(hook), lambda s: train_step(lambda: fast_process(s), opt), args.steps)
        smart_auto = auto_loop(args.steps)
        picked.append(fast_auto.auto_decision.summary())
        torch.set_num_threads(main_threads)
        loader = torch.utils.data.DataLoader(StagedDataset(data, args.batch_size, fast.partition.stage),
                                             batch_size=None, num_workers=1, prefetch_factor=4)
        it = iter(loader)
        dl = timed_loop(it, lambda vals: train_step(lambda: fast.partition.main(*vals), opt), args.steps)
        del it, loader
        torch.set_num_threads(full_threads)
        measured = {"sequential": seq, "smartstage-thread": smart, "smartstage-process": smart_process,
                    "smartstage-auto": smart_auto,
                    "dataloader": dl, "stage alone": stage_ms, "main alone": main_ms,
                    "main alone (all threads)": main_full}
        for key, values in measured.items():
            ms[key] += values
            if key in rounds:
                rounds[key].append(statistics.median(values))

    stats = {k: summarize(v) for k, v in ms.items()}
    stage, main_alone = stats["stage alone"]["median"], stats["main alone"]["median"]
    ideal = max(stage, main_alone, (stage + main_alone) / CORES)
    rows, results = [], {"ms_per_step": stats, "round_medians": rounds}
    for key in pipelined:
        step = stats[key]["median"]
        results[key] = {"samples_per_s": args.batch_size / step * 1e3,
                        "efficiency": ideal / step if key != "sequential" else None,
                        "speedup_vs_sequential": stats["sequential"]["median"] / step}
        rows.append([key, f"{step:.1f}", f"{stats[key]['p10']:.1f}-{stats[key]['p90']:.1f}",
                     f"{args.batch_size / step * 1e3:,.0f}", f"{stats['sequential']['median'] / step:.2f}x",
                     "" if key == "sequential" else f"{ideal / step:.2f}"])
    for key in ("stage alone", "main alone", "main alone (all threads)"):
        rows.append([key, f"{stats[key]['median']:.1f}", f"{stats[key]['p10']:.1f}-{stats[key]['p90']:.1f}",
                     "", "", ""])
    share = stage / (stage + stats["main alone (all threads)"]["median"])
    print_table(f"SmartStage, crossed DLRM, batch {args.batch_size}, {args.optimizer}, {cpu_line()} "
                f"(stage = {100 * share:.0f}% of the sequential step)",
                ["variant", "ms/step", "p10-p90", "samples/s", "vs sequential", "efficiency"], rows)
    print("auto:", *picked, sep="\n  ")
    results["auto_decisions"] = picked
    best = min(("smartstage-thread", "smartstage-process"), key=lambda k: stats[k]["median"])
    results.update({"stage_share_of_sequential": share, "ideal_ms": ideal, "best_smartstage": best,
                    "smartstage_vs_dataloader": stats["dataloader"]["median"] / stats[best]["median"]})
    print(f"best SmartStage ({best}) vs DataLoader: {results['smartstage_vs_dataloader']:.2f}x faster")
    print("saved", save_json("smart_stage", {"batch_size": args.batch_size, "crosses": args.crosses,
                                             "optimizer": args.optimizer, "rounds": args.rounds,
                                             "steps": args.steps, "main_threads": main_threads,
                                             "results": results}))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(pipelined) + ["stage alone", "main alone"]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.barh(keys, [stats[k]["median"] for k in keys],
            xerr=[[stats[k]["median"] - stats[k]["p10"] for k in keys],
                  [stats[k]["p90"] - stats[k]["median"] for k in keys]],
            color=["#999999", "#66c2a5", "#1b9e77", "#117755", "#8da0cb", "#fc8d62", "#e78ac3"])
    ax.axvline(ideal, color="black", linestyle="--", linewidth=1, label="ideal overlap")
    ax.set_xlabel("ms per step (median, p10-p90)")
    ax.legend(fontsize=8)
    save_figure(fig, "smart_stage")


if __name__ == "__main__":
    main()
