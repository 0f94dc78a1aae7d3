"""Multi-tier EmbeddingVariable storage: DLRM training with tables ~10x the DRAM budget.

Workload: DLRM (batch 512, Adagrad, SmartStage in a thread) with EmbeddingVariables over
synthetic Criteo-layout data whose 26 id columns are Zipf(--zipf) over cardinalities
scaled from Criteo Kaggle's so the tables hold --table-rows rows in all (12M: ~2 GB of
values + Adagrad slots). Every table starts full (a long job's state: every id already
has its row, in random order), then trains --steps steps; samples/s is the steady rate
after the trainer's 50 warm-up steps. Configurations, each in its own process (peak RSS):

    dram              all rows in DRAM (it fits this machine: the reference)
    tiered            DRAM cache of --budget (10%) of each table's bytes + disk tier, no prefetch
    tiered+prefetch   the same, SmartStage promoting batch t+1's cold rows while t trains

The disk tier is a file in --path; with this machine's RAM the page cache holds it, so
this measures the tiers' CPU cost and the hit rate, not an SSD's latency.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

from _common import cpu_line, print_table, save_figure, save_json, summarize

CONFIGS = ("dram", "tiered", "tiered+prefetch")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def cardinalities(table_rows: int) -> tuple[int, ...]:
    from deeprec.data.synth import KAGGLE_CARDINALITIES

    scale = table_rows / sum(KAGGLE_CARDINALITIES)
    return tuple(max(1, round(c * scale)) for c in KAGGLE_CARDINALITIES)


def data_file(rows: int, cards: tuple, exponent: float) -> str:
    from deeprec.data import write_synthetic

    path = os.path.join(RESULTS, f"synth-tiered-{sum(cards)}-{exponent}-{rows}.tsv")
    if not os.path.exists(path):
        os.makedirs(RESULTS, exist_ok=True)
        write_synthetic(path + ".tmp", rows, cardinalities=cards, seed=0, zipf_exponent=exponent)
        os.replace(path + ".tmp", path)
    return path


def memory_status() -> dict:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}


def populate(model, cards: tuple) -> int:
    """Every id of every table gets its row (initial values), in random order."""
    from deeprec import ops
    from deeprec.data.synth import hex_ids
    from deeprec.nn import EmbeddingVariable

    rows = 0
    for ev in (m for m in model.modules() if isinstance(m, EmbeddingVariable)):
        f = int(ev.name[1:]) - 1  # C1..C26
        strings = hex_ids(f, np.arange(cards[f]))
        values = torch.from_numpy(np.frombuffer(strings.tobytes(), dtype=np.uint8).copy())
        keys = ops.string_to_hash_key((values, torch.arange(0, 8 * (len(strings) + 1), 8)))
        keys = keys[torch.randperm(keys.numel(), generator=torch.Generator().manual_seed(f))]
        defaults = ev._defaults[torch.remainder(keys, ev._defaults.shape[0])]
        ev.load({"keys": keys, "values": defaults, "freq": torch.zeros_like(keys),
                 "version": torch.zeros_like(keys), "global_step": torch.tensor(0)})
        rows += keys.numel()
    return rows


def child(config: str, args) -> dict:
    from deeprec.nn import EmbeddingVariable, StorageOption
    from deeprec.nn.tiered import tier_summary, use_storage
    from deeprec.runtime import optimize
    from deeprec.trainer import TrainConfig, Trainer

    cards = cardinalities(args.table_rows)
    data = data_file(args.batch * (args.steps + 10), cards, args.zipf)
    cfg = TrainConfig.create(model="dlrm", data=[data], batch_size=args.batch, steps=args.steps, seed=0,
                             embedding="variable", optimizer="adagrad", lr=0.01, progress=False,
                             optimize=dict(smart_stage=True, main_threads=1,
                                           smart_stage_options=dict(executor="thread", capacity=2, num_threads=1)))
    trainer = Trainer(cfg)
    if config != "dram":  # each table's DRAM budget: --budget of its rows' bytes (DeepRec sizes tiers per variable)
        first = next(m for m in trainer.model.modules() if isinstance(m, EmbeddingVariable))
        row_bytes = 4 * (first.embedding_dim * 2) + 35  # value + Adagrad slot + bookkeeping (TieredEV._row_bytes)
        budgets = {f"C{f + 1}": max(2 << 20, int(args.budget * c * row_bytes)) for f, c in enumerate(cards)}
        use_storage(trainer.model, {name: StorageOption(tiers=["dram", "ssd"], dram_bytes=b, path=args.path,
                                                        prefetch=config.endswith("prefetch"))
                                    for name, b in budgets.items()})
        trainer.fast = optimize(trainer.model, cfg.optimize)  # sees the tiered lookups (prefetch hook)
    start = time.perf_counter()
    rows = populate(trainer.model, cards)
    populated = time.perf_counter() - start
    with open("/proc/self/clear_refs", "w") as f:  # peak RSS from here: training, not the table's construction
        f.write("5")
    before = dict(tier_summary(trainer.model) or {})
    result = trainer.train()
    tiers = tier_summary(trainer.model)
    out = {"config": config, "samples_per_s": result["steady_samples_per_s"] or result["samples_per_s"],
           "table_rows": rows, "populate_s": populated, "memory": memory_status(),
           "stage_ms_per_batch": 1e3 * result["stage"]["stage_seconds"] / max(1, result["stage"]["taken"]),
           "step_ms": 1e3 * args.batch / (result["steady_samples_per_s"] or result["samples_per_s"])}
    if tiers:
        moved = {k: tiers[k] - before.get(k, 0) for k in ("hits", "disk_reads", "prefetched", "bytes_read",
                                                         "bytes_written")}
        looked = moved["hits"] + moved["disk_reads"]
        out.update(hit_rate=moved["hits"] / looked if looked else 1.0, read_per_step=moved["bytes_read"] / args.steps,
                   written_per_step=moved["bytes_written"] / args.steps, dram_bytes=tiers["dram_bytes"],
                   disk_bytes=tiers["disk_bytes"], prefetched=moved["prefetched"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table-rows", type=int, default=12_000_000)
    parser.add_argument("--budget", type=float, default=0.10, help="DRAM budget, a fraction of each table's bytes")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--path", default=RESULTS, help="folder of the disk tier")
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    data_file(args.batch * (args.steps + 10), cardinalities(args.table_rows), args.zipf)  # once, before timing
    runs = {c: [] for c in CONFIGS}
    for _ in range(args.rounds):
        for config in CONFIGS:
            cmd = [sys.executable, __file__, "--child", config] + sum(
                ([f"--{k.replace('_', '-')}", str(v)] for k, v in vars(args).items() if k not in ("child", "rounds")), [])
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[config].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(config, runs[config][-1], flush=True)
    rate = {c: summarize([r["samples_per_s"] for r in runs[c]])["median"] for c in CONFIGS}
    rows = []
    for c in CONFIGS:
        last = runs[c][-1]
        mem = last["memory"]
        rows.append([c, f"{rate[c]:,.0f}", f"{rate[c] / rate['dram']:.2f}x",
                     f"{last.get('hit_rate', 1.0):.1%}", f"{last.get('read_per_step', 0) / 1e6:.2f}",
                     f"{last.get('dram_bytes', 0) / 2**20:,.0f}", f"{last.get('disk_bytes', 0) / 2**20:,.0f}",
                     f"{mem['VmHWM'] / 2**30:.2f}", f"{mem['RssAnon'] / 2**30:.2f}"])
    print_table(f"DLRM, {runs['dram'][-1]['table_rows']:,} table rows, Zipf {args.zipf}, DRAM budget "
                f"{args.budget:.0%} - {cpu_line()}",
                ["config", "samples/s", "vs dram", "hit rate", "MB read/step", "DRAM tier MB", "disk tier MB",
                 "peak RSS GB", "anon RSS GB"], rows)
    print("saved", save_json("tiered", {"args": {k: v for k, v in vars(args).items() if k != "child"},
                                        "runs": runs, "samples_per_s": rate}))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    left.bar(CONFIGS, [rate[c] for c in CONFIGS], color=["tab:gray", "tab:orange", "tab:green"])
    left.set_ylabel("DLRM samples/s")
    right.bar(CONFIGS, [runs[c][-1]["memory"]["VmHWM"] / 2**30 for c in CONFIGS], label="peak RSS")
    right.bar(CONFIGS, [runs[c][-1]["memory"]["RssAnon"] / 2**30 for c in CONFIGS], label="anonymous at end")
    right.set_ylabel("GB")
    right.legend(fontsize=7)
    save_figure(fig, "tiered")


if __name__ == "__main__":
    main()
