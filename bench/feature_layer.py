"""One feature layer for every model: training throughput of each model with each
embedding kind, through the trainer (read, preprocess, step, update), side by side.

    torch     one nn.Embedding(sparse=True) per table, torch.optim (SparseAdam + Adam):
              what the behaviour models (DIN, DIEN, DSSM, MMoE) used before the shared layer
    table     one EmbeddingCollection: fused hashed tables, sequences from the same fused
              lookup, shared tables deduplicated, row-sparse Adam inside the backward (default)
    variable  the same collection over EmbeddingVariables (no buckets; what a PS serves)

DLRM, DeepFM, WDL on synthetic Criteo data (Kaggle cardinalities); DIN, DIEN, DSSM on
synthetic behaviour logs (50-item histories); MMoE on them too (tasks click and like).
Batch 512, Adam lr 0.001. Each round runs every (model, kind) once, so drift hits all alike;
the rate is the trainer's steady samples/s (after 50 warm-up steps); median over rounds.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from _common import cpu_line, print_table, save_figure, save_json, synthetic_behavior, synthetic_criteo
from deeprec.trainer import TrainConfig, Trainer

CRITEO_MODELS = ("dlrm", "deepfm", "wdl")
KINDS = ("torch", "table", "variable")


def rate(model: str, kind: str, data: str, steps: int) -> float:
    cfg = TrainConfig.create(model=model, data=[data], steps=steps, batch_size=512, optimizer="adam", lr=0.001,
                      embedding=kind, progress=False, seed=0)
    return Trainer(cfg).train()["steady_samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="dlrm,deepfm,wdl,din,dien,dssm,mmoe")
    parser.add_argument("--steps", type=int, default=110, help="steps per run (the first 50 are warm-up)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args()
    models = args.models.split(",")
    data = {m: synthetic_criteo(args.rows) if m in CRITEO_MODELS else synthetic_behavior(args.rows) for m in models}
    rates = {(m, k): [] for m in models for k in KINDS}
    for _ in range(args.rounds):
        for m in models:
            for k in KINDS:
                rates[m, k].append(rate(m, k, data[m], args.steps))
    median = {key: statistics.median(v) for key, v in rates.items()}
    rows = [[m] + [f"{median[m, k]:,.0f}" for k in KINDS]
            + [f"{median[m, 'table'] / median[m, 'torch']:.2f}", f"{median[m, 'variable'] / median[m, 'torch']:.2f}"]
            for m in models]
    print_table(f"training samples/s by embedding kind, batch 512, Adam ({cpu_line()})",
                ["model", *KINDS, "table / torch", "variable / torch"], rows)
    print("saved", save_json("feature_layer", {
        "batch_size": 512, "steps": args.steps, "rounds": args.rounds, "rows": args.rows, "optimizer": "adam",
        "samples_per_s": {m: {k: {"median": median[m, k], "runs": rates[m, k]} for k in KINDS} for m in models}}))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(KINDS)
    for i, k in enumerate(KINDS):
        ax.bar([x + i * width for x in range(len(models))], [median[m, k] for m in models], width, label=k)
    ax.set_xticks([x + width for x in range(len(models))], models)
    ax.set_ylabel("samples/s (median)")
    ax.set_title(f"embedding kinds, batch 512 ({cpu_line()})", fontsize=8)
    ax.legend(fontsize=8)
    save_figure(fig, "feature_layer")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
