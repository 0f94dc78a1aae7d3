"""MultiStream, Auto Micro Batch, torch.compile and bf16, side by side on this CPU.

    A  multi-branch model (two dense towers + 8 embedding branches with MLPs):
       plain vs multi_stream (2 streams, policies "embedding" and "full")
    B  DLRM, global batch 512, SmartStage: micro_batch_num 1, 2, 4
    C  DLRM batch 512 step (pre-staged): fp32, compile, bf16, bf16 + compile
    D  DLRM trained for a fixed number of steps: fp32 vs bf16 (+ compile): eval AUC

Timings alternate the configurations round by round (the machine is noisy);
medians are reported, with ratios to the plain configuration.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

import deeprec as dr
from _common import print_table, save_figure, save_json, summarize, synthetic_criteo
from deeprec.data import CriteoReader
from deeprec.models import build_model
from deeprec.optim import make_optimizer


class MultiBranch(nn.Module):
    def __init__(self, branches: int = 8):
        super().__init__()
        tower = lambda: nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),  # noqa: E731
                                      nn.Linear(256, 64))
        self.user, self.item = tower(), tower()
        self.tables = nn.ModuleList(nn.EmbeddingBag(100_000, 32, mode="sum", sparse=True) for _ in range(branches))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 64))
                                  for _ in range(branches))

    def forward(self, batch):
        u, i = self.user(batch["user"]), self.item(batch["item"])
        side = [mlp(table(batch["ids"][:, k])) for k, (table, mlp) in enumerate(zip(self.tables, self.mlps))]
        logits = (u * i).sum(1) + torch.stack(side).sum(0).sum(1)
        return {"logits": logits, "loss": nn.functional.binary_cross_entropy_with_logits(logits, batch["label"])}


def branch_batches(n: int, batch: int = 512):
    g = torch.Generator().manual_seed(0)
    return [{"user": torch.randn(batch, 64, generator=g), "item": torch.randn(batch, 64, generator=g),
             "ids": torch.randint(0, 100_000, (batch, 8, 4), generator=g),
             "label": torch.randint(0, 2, (batch,), generator=g).float()} for _ in range(n)]


def timed_steps(run_one, items) -> list[float]:
    out = []
    for item in items:
        start = time.perf_counter()
        run_one(item)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def alternate(configs: dict, rounds: int) -> dict:
    """configs: name -> function() returning per-step ms of one round."""
    samples = {name: [] for name in configs}
    for _ in range(rounds):
        for name, fn in configs.items():
            samples[name] += fn()
    return {name: summarize(v) for name, v in samples.items()}


def section_streams(rounds: int) -> dict:
    items = branch_batches(12)
    base = MultiBranch()
    configs = {}
    for name, ms in (("plain", None), ("streams embedding", dr.MultiStreamOptions(2, "embedding")),
                     ("streams full", dr.MultiStreamOptions(2, "full"))):
        model = copy.deepcopy(base)
        fast = dr.optimize(model, dr.Config(multi_stream=ms)) if ms else model
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def one(item, fast=fast, opt=opt):
            fast(item)["loss"].backward()
            opt.step()
            opt.zero_grad()

        one(items[0])
        configs[name] = lambda one=one: timed_steps(one, items[2:])
    return alternate(configs, rounds)


def dlrm_batches(path: str, n: int, batch: int = 512) -> list:
    out = []
    for b in CriteoReader(path, batch_size=batch):
        out.append(b)
        if len(out) == n:
            return out
    return out


def section_micro_batch(path: str, rounds: int, steps: int) -> dict:
    configs, losses = {}, {}
    for n in (1, 2, 4):
        torch.manual_seed(0)
        model = build_model("dlrm")
        fast = dr.optimize(model, dr.Config(smart_stage=True, micro_batch_num=n))
        opt = make_optimizer(model, "adagrad", 0.01)

        def one_round(fast=fast, opt=opt, n=n):
            times, start = [], time.perf_counter()
            reader = CriteoReader(path, batch_size=512)
            for k, out in enumerate(fast.iterate(reader, backward=True)):
                opt.step()
                opt.zero_grad()
                now = time.perf_counter()
                times.append((now - start) * 1e3)
                start = now
                losses[f"micro_batch {n}"] = out["loss"].item()
                if k + 1 == steps:
                    break
            return times[2:]

        configs[f"micro_batch {n}"] = one_round
    result = alternate(configs, rounds)
    for name in result:
        result[name]["last_loss"] = losses[name]
    return result


def section_precision(path: str, rounds: int) -> dict:
    batches = dlrm_batches(path, 14)
    configs = {}
    variants = {"fp32": dr.Config(smart_stage=True), "compile": dr.Config(smart_stage=True, graph_fusion=True),
                "bf16": dr.Config(smart_stage=True, bf16=True),
                "bf16 + compile": dr.Config(smart_stage=True, bf16=True, graph_fusion=True)}
    for name, cfg in variants.items():
        torch.manual_seed(0)
        model = build_model("dlrm")
        fast = dr.optimize(model, cfg)
        opt = make_optimizer(model, "adagrad", 0.01)
        staged = [fast.stage(b) for b in batches]

        def one(item, fast=fast, opt=opt):
            fast(item)["loss"].backward()
            opt.step()
            opt.zero_grad()

        for item in staged[:3]:  # warm-up (compilation)
            one(item)
        configs[name] = lambda one=one, staged=staged: timed_steps(one, staged[4:])
    return alternate(configs, rounds)


def section_auc(steps: int) -> dict:
    """Small cardinalities, so that a few hundred steps learn the planted model."""
    from deeprec.trainer import TrainConfig, Trainer

    path = synthetic_criteo(200_000, cardinalities="small")
    out = {}
    for name, kw in (("fp32", {}), ("bf16", {"bf16": True}), ("bf16 + compile", {"bf16": True, "graph_fusion": True})):
        cfg = TrainConfig.create(model="dlrm", data=[path], steps=steps, batch_size=512, optimizer="adam", lr=0.003,
                                 eval_fraction=0.1, progress=False, seed=0, optimize=dict(smart_stage=True, **kw))
        result = Trainer(cfg).train()
        out[name] = {"auc": result["eval"]["auc"], "logloss": result["eval"]["logloss"],
                     "samples_per_s": result["samples_per_s"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro-steps", type=int, default=20)
    parser.add_argument("--auc-steps", type=int, default=300)
    parser.add_argument("--sections", default="streams,micro_batch,precision,auc",
                        help="comma-separated subset; the others are kept from the last saved results")
    args = parser.parse_args()
    path = synthetic_criteo(200_000)
    wanted = args.sections.split(",")
    results = {}
    if set(wanted) != {"streams", "micro_batch", "precision", "auc"}:
        import json
        import os

        from _common import RESULTS
        with open(os.path.join(RESULTS, "graph_opts.json")) as f:
            results = json.load(f)["results"]
    runs = {"streams": lambda: section_streams(args.rounds),
            "micro_batch": lambda: section_micro_batch(path, args.rounds, args.micro_steps),
            "precision": lambda: section_precision(path, args.rounds), "auc": lambda: section_auc(args.auc_steps)}
    for name in wanted:
        results[name] = runs[name]()
    rows = []
    for section, base in (("streams", "plain"), ("micro_batch", "micro_batch 1"), ("precision", "fp32")):
        ref = results[section][base]["median"]
        for name, r in results[section].items():
            batch = 512
            extra = f"loss {r['last_loss']:.4f}" if "last_loss" in r else ""
            rows.append([section, name, f"{r['median']:.1f}", f"{r['p10']:.1f}-{r['p90']:.1f}",
                         f"{batch / r['median'] * 1e3:,.0f}", f"{ref / r['median']:.2f}x", extra])
    for name, r in results["auc"].items():
        rows.append(["auc", name, "", "", f"{r['samples_per_s']:,.0f}", "",
                     f"AUC {r['auc']:.4f} ({r['auc'] - results['auc']['fp32']['auc']:+.4f})"])
    print_table("graph options on this CPU (ms per step, median of alternating rounds)",
                ["section", "config", "ms/step", "p10-p90", "samples/s", "speed-up", "quality"], rows)
    print("saved", save_json("graph_opts", {"args": vars(args), "results": results}))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3))
    for ax, section in zip(axes, ("streams", "micro_batch", "precision")):
        names = list(results[section])
        ax.bar(range(len(names)), [results[section][n]["median"] for n in names])
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=7)
        ax.set_title(section, fontsize=9)
        ax.set_ylabel("ms per step")
    save_figure(fig, "graph_opts")


if __name__ == "__main__":
    main()
