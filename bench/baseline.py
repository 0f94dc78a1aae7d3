"""Baseline training throughput: plain PyTorch models, no deeprec optimization.

Each step of the plain loop, timed in three parts, batch 512 (DeepRec's CPU
batch size; DSSM 4096): DLRM, DeepFM, WDL on synthetic Criteo data (Kaggle
cardinalities); DIN, DIEN, DSSM, MMoE on synthetic behaviour logs (50-item
histories; MMoE's two tasks click and like):

    read+parse      next(reader): pyarrow parse of the text chunk, batch assembly
    preprocess      the model's own feature ops on the raw batch (hashing, filling,
                    sequence padding), timed alone: the data-side subgraph that
                    SmartStage would run ahead, called here inline
    fwd+bwd+update  the full train step minus the preprocess time above

samples/s counts read + full step only (the separate preprocess call is not
part of the loop). Rounds alternate between models so drift hits them alike.
samples/s: median and p10-p90 over rounds. The split is the mean ms per step,
so that it adds up: a 4 MB chunk is parsed once per ~40 batches, and a median
would hide that cost.
"""
from __future__ import annotations

import argparse
import time

import torch

import deeprec as dr
from _common import save_figure, print_table, save_json, summarize, synthetic_behavior, synthetic_criteo
from deeprec.data import PRESETS, CriteoReader, CsvReader
from deeprec.models import build_model
from deeprec.optim import make_optimizer

BATCH = {"dssm": 4096}  # DeepRec's modelzoo batch sizes on CPU; 512 otherwise


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - start) * 1e3


BEHAVIOR_MODELS = ("din", "dien", "dssm", "mmoe")  # trained on synthetic behaviour data here


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="dlrm,deepfm,wdl,din,dien,dssm,mmoe")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--steps-per-round", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--optimizer", default="adam", help="as deeprec train: adam | adagrad | sgd")
    parser.add_argument("--embedding", default="torch", help="torch (plain nn.Embedding, the baseline) | table")
    args = parser.parse_args()
    torch.manual_seed(0)

    names = args.models.split(",")
    setups, batch_sizes = {}, {}
    for name in names:
        batch_size = batch_sizes[name] = BATCH.get(name, args.batch_size)
        if name in BEHAVIOR_MODELS:
            schema = PRESETS["behavior"]
            model = build_model(name, schema=schema, embedding=args.embedding)
            reader = CsvReader(synthetic_behavior(args.rows), schema, batch_size, num_epochs=None, drop_remainder=True)
        else:
            model = build_model(name, embedding=args.embedding)
            reader = CriteoReader(synthetic_criteo(args.rows), batch_size, num_epochs=None, drop_remainder=True)
        preprocess = dr.optimize(model, dr.Config(smart_stage=True)).partition.stage  # timing only
        setups[name] = (model, make_optimizer(model, args.optimizer, 1e-3), iter(reader), preprocess)
    parts = {name: {"read": [], "preprocess": [], "compute": [], "step": []} for name in names}
    throughput = {name: [] for name in names}

    def step(name, record: bool):
        model, opt, batches, preprocess = setups[name]
        batch, t_read = timed(lambda: next(batches))
        _, t_pre = timed(lambda: preprocess(batch))  # the model's own feature ops, alone

        def train_step():
            model(batch)["loss"].backward()
            opt.step()
            opt.zero_grad()

        _, t_step = timed(train_step)
        if record:
            p = parts[name]
            p["read"].append(t_read)
            p["preprocess"].append(t_pre)
            p["compute"].append(t_step - t_pre)
            p["step"].append(t_read + t_step)

    for name in names:
        for _ in range(args.warmup):
            step(name, record=False)
    for _ in range(args.rounds):
        for name in names:
            before = len(parts[name]["step"])
            for _ in range(args.steps_per_round):
                step(name, record=True)
            ms = sum(parts[name]["step"][before:])
            throughput[name].append(batch_sizes[name] * args.steps_per_round / (ms / 1e3))

    results, rows = {}, []
    for name in names:
        stats = {k: summarize(v) for k, v in parts[name].items()}
        rate = summarize(throughput[name])
        total = stats["read"]["mean"] + stats["preprocess"]["mean"] + stats["compute"]["mean"]
        results[name] = {"samples_per_s": rate, "ms_per_step": stats}
        rows.append([name, str(batch_sizes[name]), f"{rate['median']:,.0f}", f"{rate['p10']:,.0f}-{rate['p90']:,.0f}"]
                    + [f"{stats[k]['mean']:.1f} ({100 * stats[k]['mean'] / total:.0f}%)"
                       for k in ("read", "preprocess", "compute")])
    print_table(f"baseline training, {args.optimizer}, {torch.get_num_threads()} threads, synthetic data",
                ["model", "batch", "samples/s", "p10-p90", "read+parse ms", "preprocess ms", "fwd+bwd+update ms"], rows)
    print("saved", save_json("baseline", {"batch_size": batch_sizes, "rows": args.rows,
                                          "rounds": args.rounds, "steps_per_round": args.steps_per_round,
                                          "optimizer": args.optimizer,
                                          "results": results}))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.6 * len(names)))
    left = [0.0] * len(names)
    for part, color in (("read", "#8da0cb"), ("preprocess", "#fc8d62"), ("compute", "#66c2a5")):
        widths = [results[n]["ms_per_step"][part]["mean"] for n in names]
        ax.barh(names, widths, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("ms per step (mean; batch 512, DSSM 4096)")
    ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, "baseline")


if __name__ == "__main__":
    main()
