"""End to end: DLRM training throughput from a Criteo TSV, every way we run it, side by side.

Workload: DLRM (modelzoo sizes, 10,000 hash buckets per feature) on a synthetic Criteo
TSV with Kaggle cardinalities, batch 512, Adagrad lr 0.01, all cores. Variants:

    step alone          forward+backward+update on pre-staged batches (no reading, no preprocessing)
    train plain         `deeprec train` (read -> forward with preprocessing -> backward -> update)
    smart-stage auto    `deeprec train --smart-stage` (executor auto: measures, then picks)
    smart-stage thread  `... --stage-executor thread`
    smart-stage process `... --stage-executor process`
    train bf16 auto     `deeprec train --bf16 auto`
    dataloader          torch DataLoader(reader, num_workers=1) feeding the plain model
    tf.data + keras     TensorFlow 2.21, tf.data + Keras DLRM (bench/tf_dlrm.py, own venv .venv-tf),
                        with and without jit_compile (XLA); skipped with a message if absent

Rates are steady-state samples/s (after 50 warm-up / calibration steps), medians over rounds;
the variants of a round run back to back. Also reported: minor page faults per step
(getrusage) and samples/s of the plain loop under glibc's malloc, glibc with MALLOC_* tunables
(the seed's CPU memory optimization targets the page faults of large allocations), and mimalloc
when the optional bench extra is installed.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from _common import cpu_line, print_table, save_figure, save_json, synthetic_criteo
import deeprec as dr
from deeprec.data import KAGGLE_CARDINALITIES, CriteoReader
from deeprec.models import build_model
from deeprec.optim import make_optimizer
from deeprec.trainer import TrainConfig, Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TF_PYTHON = os.environ.get("DEEPREC_TF_PYTHON", os.path.join(ROOT, ".venv-tf", "bin", "python"))


def train_rate(data: str, steps: int, model: str = "dlrm", **options) -> float:
    cfg = TrainConfig.create(model=model, data=[data], steps=steps, optimizer="adagrad", lr=0.01, batch_size=512,
                             progress=False, **options)
    result = Trainer(cfg).train()
    return result["steady_samples_per_s"], result


def staged(executor: str, **options) -> dict:
    return dict(smart_stage=True, smart_stage_options=dict(executor=executor, **options))


def step_alone_rate(data: str, steps: int) -> float:
    torch.manual_seed(0)
    model = build_model("dlrm")
    opt = make_optimizer(model, "adagrad", 0.01)
    fast = dr.optimize(model, dr.Config(smart_stage=True))
    staged = [fast.stage(b) for b in itertools.islice(CriteoReader(data, 512), 64)]
    for item in staged[:10]:
        fast(item)["loss"].backward()
        opt.step(), opt.zero_grad()
    start = time.perf_counter()
    for item in itertools.islice(itertools.cycle(staged), steps):
        fast(item)["loss"].backward()
        opt.step(), opt.zero_grad()
    return steps * 512 / (time.perf_counter() - start)


def dataloader_rate(data: str, steps: int) -> float:
    torch.manual_seed(0)
    model = build_model("dlrm")
    opt = make_optimizer(model, "adagrad", 0.01)
    loader = torch.utils.data.DataLoader(CriteoReader(data, 512, num_epochs=None), batch_size=None,
                                         num_workers=1, prefetch_factor=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads - 1))  # the worker process takes a core
    try:
        it = iter(loader)
        start = None
        for k in range(steps + 50):
            if k == 50:
                start = time.perf_counter()
            model(next(it))["loss"].backward()
            opt.step(), opt.zero_grad()
        return steps * 512 / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


def tf_rate(data: str, steps: int, jit: bool, model: str = "dlrm") -> float | None:
    if not os.path.exists(TF_PYTHON):
        return None
    cmd = [TF_PYTHON, os.path.join(ROOT, "bench", "tf_dlrm.py"), "--data", data, "--steps", str(steps), "--model", model]
    done = subprocess.run(cmd + (["--jit"] if jit else []), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        print(f"TensorFlow run failed: {done.stderr[-500:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])["samples_per_s"]


def _mimalloc() -> str | None:
    from deeprec.serving.allocator import mimalloc_library  # the cmeel-mimalloc wheel, a dependency

    return mimalloc_library()


def allocators(data: str, steps: int, rounds: int) -> dict:
    """Minor page faults per step and samples/s of the plain loop, one child process per allocator
    setting, settings interleaved over rounds (medians)."""
    settings = {"glibc default": {}, "glibc tuned (deeprec.runtime.memory.tune_malloc)": {"BENCH_TUNE_MALLOC": "1"}}
    if _mimalloc():
        settings["mimalloc (LD_PRELOAD)"] = {"LD_PRELOAD": _mimalloc()}
    else:
        print("mimalloc skipped: the cmeel-mimalloc wheel (a dependency) is not installed")
    runs = {name: [] for name in settings}
    for _ in range(rounds):
        for name, env in settings.items():
            code = ("import sys; sys.path.insert(0, 'bench'); import e2e; "
                    f"print(e2e._faults_child({data!r}, {steps}))")
            done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, cwd=ROOT,
                                  capture_output=True, text=True, timeout=1800)
            if done.returncode == 0:
                runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {name: {key: statistics.median(r[key] for r in results) for key in results[0]}
            for name, results in runs.items() if results}


def _faults_child(data: str, steps: int) -> str:
    if os.environ.get("BENCH_TUNE_MALLOC"):
        from deeprec.runtime.memory import tune_malloc

        tune_malloc()
    torch.manual_seed(0)
    model = build_model("dlrm")
    opt = make_optimizer(model, "adagrad", 0.01)
    batches = iter(CriteoReader(data, 512, num_epochs=None))
    for _ in range(30):
        model(next(batches))["loss"].backward()
        opt.step(), opt.zero_grad()
    before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    for _ in range(steps):
        model(next(batches))["loss"].backward()
        opt.step(), opt.zero_grad()
    elapsed = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return json.dumps({"minor_faults_per_step": faults / steps, "samples_per_s": steps * 512 / elapsed})


def embedding_kinds(data: str, steps: int, rounds: int) -> dict:
    """`deeprec train` of DLRM at Criteo-Kaggle cardinalities (33.8M rows), --embedding table (hashed
    tables that large) vs --embedding variable (an EmbeddingVariable per column: only the keys seen),
    the two alternating over rounds; samples/s after the warm-up."""
    kinds = {"--embedding table": "table", "--embedding variable": "variable"}
    rates = {name: [] for name in kinds}
    for _ in range(rounds):
        for name, kind in kinds.items():
            rates[name].append(train_rate(data, steps + 50, embedding=kind,
                                          model_overrides={"hash_buckets": list(KAGGLE_CARDINALITIES)})[0])
    median = {name: statistics.median(r) for name, r in rates.items()}
    ratio = median["--embedding variable"] / median["--embedding table"]
    print_table(f"DLRM, Kaggle cardinalities, deeprec train, batch 512, Adagrad ({cpu_line()})",
                ["embedding", "samples/s", "per round"],
                [[name, f"{median[name]:,.0f}", " ".join(f"{r:,.0f}" for r in rates[name])] for name in kinds])
    print(f"variable >= 1.0 x table: {ratio:.2f}")
    return {"samples_per_s": rates, "median": median, "variable_vs_table": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--steps", type=int, default=250, help="steady-state steps per variant per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--embedding-only", action="store_true",
                        help="only the embedding kinds (table vs variable at Kaggle cardinalities)")
    args = parser.parse_args()
    data = synthetic_criteo(args.rows)
    kinds = embedding_kinds(data, args.steps, args.rounds + 1)
    if args.embedding_only:
        print("saved", save_json("e2e_embedding", {"rows": args.rows, "steps": args.steps, **kinds}))
        return
    total = args.steps + 50
    variants = {
        "step alone": lambda: step_alone_rate(data, args.steps),
        "train plain": lambda: train_rate(data, total)[0],
        "smart-stage auto": lambda: train_rate(data, total, optimize=staged("auto"))[0],
        "smart-stage thread": lambda: train_rate(data, total, optimize=staged("thread"))[0],
        "smart-stage process": lambda: train_rate(data, total, optimize=staged("process", capacity=4))[0],
        "train bf16 auto": lambda: train_rate(data, total, optimize=dict(bf16="auto"))[0],
        "dataloader (1 worker)": lambda: dataloader_rate(data, args.steps),
        "tf.data + keras": lambda: tf_rate(data, args.steps, jit=False),
        "tf.data + keras xla": lambda: tf_rate(data, args.steps, jit=True),
    }
    rates = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            rate = run()
            if rate is not None:
                rates[name].append(rate)
    if not rates["tf.data + keras"]:
        print(f"TensorFlow skipped: no {TF_PYTHON} (make bench-tf-venv creates it)")
    auto = Trainer(TrainConfig.create(model="dlrm", data=[data], steps=80, optimizer="adagrad", lr=0.01,
                                      progress=False, optimize=staged("auto"))).train().get("auto")
    median = {k: statistics.median(v) for k, v in rates.items() if v}
    step, plain = median["step alone"], median["train plain"]
    rows = [[k, f"{v:,.0f}", f"{v / step:.2f}", f"{v / plain:.2f}", " ".join(f"{r:,.0f}" for r in rates[k])]
            for k, v in median.items()]
    print_table(f"DLRM end to end, batch 512, Adagrad ({cpu_line()})",
                ["variant", "samples/s", "vs step alone", "vs plain", "per round"], rows)
    faults = allocators(data, 200, args.rounds + 1)
    base = faults["glibc default"]["samples_per_s"]
    print_table("allocators: the plain loop in a child process each (medians)",
                ["allocator", "minor page faults / step", "samples/s", "vs default"],
                [[name, f"{r['minor_faults_per_step']:.1f}", f"{r['samples_per_s']:,.0f}",
                  f"{r['samples_per_s'] / base:.3f}"] for name, r in faults.items()])
    targets = {"plain >= 0.85 x step alone": plain / step,
               "smart-stage auto >= 1.0 x plain": median["smart-stage auto"] / plain}
    if "tf.data + keras xla" in median:
        targets["plain >= 1.5 x tf.data + keras xla"] = plain / median["tf.data + keras xla"]
    for name, ratio in targets.items():
        print(f"{name}: {ratio:.2f}")
    print("auto:", auto)
    print("saved", save_json("e2e", {"rows": args.rows, "steps": args.steps, "rounds": args.rounds,
                                     "samples_per_s": rates, "median": median, "ratios": targets,
                                     "auto_decision": auto, "page_faults": faults, "embedding_kinds": kinds}))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    names = list(median)
    ax.barh(names, [median[k] for k in names], color=["#999999"] + ["#1b9e77"] * 5 + ["#8da0cb"] + ["#fc8d62"] * 2)
    ax.axvline(0.85 * step, color="black", linestyle="--", linewidth=1, label="0.85 x step alone")
    ax.invert_yaxis()
    ax.set_xlabel("samples/s (median over rounds)")
    ax.legend(fontsize=8)
    save_figure(fig, "e2e")


if __name__ == "__main__":
    main()
