"""Speed of two source trees side by side: bench/e2e.py's DLRM training, rounds interleaved.

Each measurement is one child process run in a tree (cwd and PYTHONPATH set to it) that imports
that tree's own bench/e2e.py and calls its measurement function, so each tree is timed the way
its e2e.py times it:

    train plain   e2e.train_rate: `deeprec train` of DLRM, batch 512, Adagrad lr 0.01, all cores,
                  on a synthetic Kaggle-cardinality Criteo TSV; steady samples/s after 50 warm-up steps
                  (also rows per second of the process's CPU time over the whole run, warm-up included:
                  less sensitive to other work on a shared machine than wall time, though not immune)
    step alone    e2e.step_alone_rate: forward+backward+update on pre-staged batches (--variants)

Rounds alternate the order (before, after), (after, before), ... so drift on a shared machine
falls on both trees alike. Reported per variant and tree: the median, min and max over rounds,
every round's value, and after/before as the ratio of the medians and the median of the
per-round ratios (each round's two runs ran back to back). The data is written once into
bench/results/synth-kaggle-<rows>.tsv (the file bench/e2e.py uses) by the first tree.

    python bench/before_after.py --before /tmp/before --after .
    python bench/before_after.py --before /tmp/before --after . --rounds 5 --variants "train plain" "step alone"
    python bench/before_after.py --before /tmp/before --after . --threads 1 --rounds 4   # busy machine

Writes bench/results/<--out>.json and .png (default: before_after.json, before_after.png).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(BENCH, "results")
DISTRIBUTED_ENV = ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
CHILD = {
    "train plain": "import time\ncpu = time.process_time()\n"
                   "rate, result = e2e.train_rate({data!r}, {steps} + 50)\n"
                   "out = dict(samples_per_s=rate, all_samples_per_s=result['samples_per_s'], "
                   "cpu_samples_per_s=result['rows'] / (time.process_time() - cpu), final_loss=result['final_loss'])",
    "step alone": "out = dict(samples_per_s=e2e.step_alone_rate({data!r}, {steps}))",
    # the reader alone: the TSV's batches of 512 as `deeprec train` gets them (parsed, converted), after 20
    "read": "import itertools, time\nit = iter(deeprec.data.CriteoReader({data!r}, 512))\n"
            "list(itertools.islice(it, 20))\nstart = time.perf_counter()\nn = sum(1 for _ in itertools.islice(it, {steps}))\n"
            "out = dict(samples_per_s=n * 512 / (time.perf_counter() - start))",
    # Wide & Deep (two FeatureEmbedders over the same ids), `deeprec train` as is and with SmartStage auto
    "train plain wdl": "rate, result = e2e.train_rate({data!r}, {steps} + 50, model='wdl')\n"
                       "out = dict(samples_per_s=rate, final_loss=result['final_loss'])",
    "train plain deepfm": "rate, result = e2e.train_rate({data!r}, {steps} + 50, model='deepfm')\n"
                          "out = dict(samples_per_s=rate, final_loss=result['final_loss'])",
    "train staged wdl": "rate, result = e2e.train_rate({data!r}, {steps} + 50, model='wdl', optimize=e2e.staged('auto'))\n"
                        "out = dict(samples_per_s=rate, final_loss=result['final_loss'])",
}
PRELUDE = "import json, sys\nsys.path.insert(0, 'bench')\nimport deeprec, e2e\n"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def child(tree: str, code: str, timeout: int, threads: int | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    env.update(PYTHONPATH=tree, CUDA_VISIBLE_DEVICES="")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"child in {tree} exited {done.returncode}:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not os.path.realpath(result["deeprec"]).startswith(os.path.realpath(tree) + os.sep):
        raise RuntimeError(f"import deeprec in {tree} resolved to {result['deeprec']}")
    return result


def measure(tree: str, variant: str, data: str, steps: int, timeout: int, threads: int | None) -> dict:
    code = (PRELUDE + (f"import torch\ntorch.set_num_threads({threads})\n" if threads else "")
            + CHILD[variant].format(data=data, steps=steps)
            + "\nprint(json.dumps(dict(out, deeprec=deeprec.__file__)))")
    return child(tree, code, timeout, threads)


def synthetic(tree: str, rows: int) -> str:
    """results/synth-kaggle-<rows>.tsv as bench/_common.synthetic_criteo writes it (seed 0), once."""
    path = os.path.join(RESULTS, f"synth-kaggle-{rows}.tsv")
    if not os.path.exists(path):
        os.makedirs(RESULTS, exist_ok=True)
        code = ("import json, os, deeprec\nfrom deeprec.data import write_synthetic\n"
                f"write_synthetic({path + '.tmp'!r}, {rows}, cardinalities='kaggle', seed=0)\n"
                f"os.replace({path + '.tmp'!r}, {path!r})\nprint(json.dumps(dict(deeprec=deeprec.__file__)))")
        child(tree, code, 1800)
    return path


def describe(tree: str) -> dict:
    git = lambda *a: subprocess.run(["git", "-C", tree, *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {"path": tree, "commit": git("rev-parse", "HEAD"),
            "uncommitted": [line for line in git("status", "--porcelain").splitlines() if line]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the reference source tree (deeprec/_C built in place)")
    parser.add_argument("--after", default=os.path.dirname(BENCH), help="the tree compared (default: this one)")
    parser.add_argument("--variants", nargs="+", choices=tuple(CHILD), default=["train plain"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="before_after", help="name of the JSON and PNG in bench/results/")
    parser.add_argument("--steps", type=int, default=80, help="steady-state steps per run (default: 80)")
    parser.add_argument("--rows", type=int, default=100_000, help="synthetic rows (default: 100,000)")
    parser.add_argument("--threads", type=int, help="torch threads of each run (default: all cores, as e2e.py); "
                        "1 with the CPU-time rate is the steadier measure on a busy machine")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per child run")
    args = parser.parse_args()
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}

    load_start = os.getloadavg()
    data = synthetic(trees["before"], args.rows)
    runs = {v: {t: [] for t in trees} for v in args.variants}
    extra = {v: {t: [] for t in trees} for v in args.variants}
    started = time.perf_counter()
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for variant in args.variants:
            for name in order:
                result = measure(trees[name], variant, data, args.steps, args.timeout, args.threads)
                runs[variant][name].append(result["samples_per_s"])
                extra[variant][name].append({k: v for k, v in result.items() if k not in ("samples_per_s", "deeprec")})
                print(f"round {r + 1} {variant:<12} {name:<7} {result['samples_per_s']:>9,.0f} samples/s", flush=True)
    seconds = time.perf_counter() - started

    summary = {}
    for variant, by_tree in runs.items():
        med = {t: statistics.median(v) for t, v in by_tree.items()}
        paired = [a / b for a, b in zip(by_tree["after"], by_tree["before"])]
        summary[variant] = {
            "median": med, "min": {t: min(v) for t, v in by_tree.items()},
            "max": {t: max(v) for t, v in by_tree.items()},
            "ratio_of_medians": med["after"] / med["before"], "paired_ratios": paired,
            "median_paired_ratio": statistics.median(paired)}
        cpu = {t: [d["cpu_samples_per_s"] for d in extra[variant][t] if "cpu_samples_per_s" in d] for t in trees}
        if all(cpu.values()):
            cpu_med = {t: statistics.median(v) for t, v in cpu.items()}
            summary[variant]["cpu_time"] = {"median": cpu_med, "per_round": cpu,
                                            "ratio_of_medians": cpu_med["after"] / cpu_med["before"]}

    import torch

    title = (f"DLRM end to end (bench/e2e.py), batch 512, Adagrad, {args.threads or 'all'} threads, "
             f"{cpu_model()}, {os.cpu_count()} cores, "
             f"torch {torch.__version__}; {args.rounds} interleaved rounds, load average "
             f"{load_start[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print("\n" + title)
    header = f"{'variant':<12} {'tree':<7} {'median':>9} {'min':>9} {'max':>9}  per round"
    print(header + "\n" + "-" * (len(header) + 20))
    for variant, s in summary.items():
        for t in trees:
            rounds = " ".join(f"{x:,.0f}" for x in runs[variant][t])
            print(f"{variant:<12} {t:<7} {s['median'][t]:>9,.0f} {s['min'][t]:>9,.0f} {s['max'][t]:>9,.0f}  {rounds}")
        print(f"{variant:<12} after/before: {s['ratio_of_medians']:.3f} (ratio of medians), "
              f"{s['median_paired_ratio']:.3f} (median of per-round ratios: "
              + " ".join(f"{x:.3f}" for x in s["paired_ratios"]) + ")")
        if "cpu_time" in s:
            c = s["cpu_time"]
            print(f"{variant:<12} per CPU second: " + ", ".join(
                f"{t} {c['median'][t]:,.0f} ({' '.join(f'{x:,.0f}' for x in c['per_round'][t])})" for t in trees)
                + f"; after/before {c['ratio_of_medians']:.3f}")

    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{args.out}.json")
    with open(path, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpu_model": cpu_model(), "cpus": os.cpu_count(),
                   "torch": torch.__version__, "python": platform.python_version(),
                   "load_average_start": load_start, "load_average_end": os.getloadavg(), "seconds": seconds,
                   "trees": {t: describe(p) for t, p in trees.items()}, "rows": args.rows, "steps": args.steps,
                   "rounds": args.rounds, "threads": args.threads, "samples_per_s": runs, "details": extra,
                   "summary": summary}, f, indent=2)
    print("saved", path)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(variant, "samples/s", s["median"], runs[variant], s["ratio_of_medians"]) for variant, s in summary.items()]
    panels += [(f"{variant}, per CPU second", "samples per CPU second", s["cpu_time"]["median"],
                s["cpu_time"]["per_round"], s["cpu_time"]["ratio_of_medians"])
               for variant, s in summary.items() if "cpu_time" in s]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (title, unit, med, per_round, ratio) in zip(axes[0], panels):
        names = list(trees)
        ax.bar(names, [med[t] for t in names], color=["#999999", "#1b9e77"], label="median")
        for i, t in enumerate(names):
            ax.plot([i] * len(per_round[t]), per_round[t], "o", color="black", markersize=4,
                    label="rounds" if i == 0 else None)
        ax.set_title(f"{title}: after/before {ratio:.3f}", fontsize=10)
        ax.set_ylabel(unit)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"bench/e2e.py train plain, {args.threads or 'all'} threads; {cpu_model()}, {os.cpu_count()} cores, "
                 f"{args.rounds} interleaved rounds", fontsize=9)
    fig.tight_layout()
    png = os.path.join(RESULTS, f"{args.out}.png")
    fig.savefig(png)
    print("saved", png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
