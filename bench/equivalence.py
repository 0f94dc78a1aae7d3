"""Bitwise equivalence of two source trees: the same training runs, the same losses and weights.

For each --tree (a checkout of deeprec with its C++ extension built in place), runs in a
subprocess with cwd and PYTHONPATH set to that tree, on CPU, fp32, one intra-op thread:

    local       deeprec train --model dlrm --steps 300 --batch-size 512 --threads 1 --no-progress
                (the bundled 200-row Criteo sample, 20% held out: 160 rows a step, repeated;
                the loss falls to ~1e-8, so the checkpoint's tensors are the sharper check)
    collective  deeprec launch --workers 2 --collective -- train --model dlrm --embedding variable
                --steps 300 --batch-size 64 --threads 1 --no-progress   (2 gloo ranks on loopback)

each with --seed 0, --json and --checkpoint-dir in a temporary folder. The first tree is the
reference; every other tree is compared with it, run by run and rank by rank:

    final loss        the JSON's final_loss, compared as floats (exactly)
    model tensors     the checkpoint's "model" state: the same names, and torch.equal (same dtype,
                      shape and bits) for every tensor; other entries compared with ==
    other tensors     the rest of the checkpoint (optimizer state, RNG): reported, not part of the
                      verdict, since a restructuring may lay it out differently

It prints a table (tree, run, rank, steps, final loss) and "bitwise equal: yes/no" with the first
differing entry, and writes bench/results/equivalence.json with the CPU model (/proc/cpuinfo),
torch version, each tree's commit and uncommitted changes, and every loss.

    python bench/equivalence.py --tree /tmp/before --tree .          # before vs this tree
    python bench/equivalence.py --tree . --tree .                    # run-to-run determinism
    python bench/equivalence.py --tree /tmp/before --tree . --synthetic 200000  # non-trivial loss

Exit status: 0 when every compared tree is bitwise equal to the reference, 1 when not,
2 when a run fails.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(BENCH, "results")
# Environment that would make a local run a PS worker or a collective rank.
DISTRIBUTED_ENV = ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def tree_env(tree: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    env.update(PYTHONPATH=tree, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    return env


def run(cmd: list[str], tree: str, log: str, timeout: int) -> None:
    """cmd in tree; its output to log; a failure raises with the output's tail."""
    start = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(cmd, cwd=tree, env=tree_env(tree), stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout)
    if done.returncode != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} in {tree} exited {done.returncode}:\n{tail}")
    print(f"  {os.path.basename(log)[:-4]:<11} {time.perf_counter() - start:6.1f} s", flush=True)


def describe(tree: str) -> dict:
    """Which deeprec the tree's subprocesses import, its commit and its uncommitted files."""
    found = subprocess.run([sys.executable, "-c", "import deeprec, torch; print(deeprec.__file__)"],
                           cwd=tree, env=tree_env(tree), capture_output=True, text=True)
    if found.returncode != 0:
        raise RuntimeError(f"import deeprec fails in {tree}:\n{found.stderr[-3000:]}")
    module = found.stdout.strip().splitlines()[-1]
    if not os.path.realpath(module).startswith(os.path.realpath(tree) + os.sep):
        raise RuntimeError(f"import deeprec in {tree} resolves to {module}, outside the tree")
    git = lambda *a: subprocess.run(["git", "-C", tree, *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {"path": os.path.realpath(tree), "deeprec": module, "commit": git("rev-parse", "HEAD"),
            "subject": git("log", "-1", "--format=%s")[:120],
            "uncommitted": [line for line in git("status", "--porcelain").splitlines() if line]}


def train_runs(tree: str, work: str, args) -> dict:
    """{run: {"ranks": [{"final_loss", "steps", "checkpoint"}], "seconds"}} of one tree."""
    data = ["--synthetic", str(args.synthetic)] if args.synthetic else []
    common = ["--model", "dlrm", "--threads", "1", "--no-progress", "--seed", "0", *data]
    py = [sys.executable, "-m", "deeprec"]
    runs = {
        "local": (py + ["train", *common, "--steps", str(args.steps), "--batch-size", str(args.batch_size)], 1),
        "collective": (py + ["launch", "--workers", "2", "--collective", "--", "train", *common,
                             "--embedding", "variable", "--steps", str(args.collective_steps),
                             "--batch-size", str(args.collective_batch_size)], 2),
    }
    results = {}
    for name in args.runs:
        cmd, world = runs[name]
        ckpt = os.path.join(work, f"{name}-ckpt")
        cmd = cmd + ["--json", os.path.join(work, f"{name}.json"), "--checkpoint-dir", ckpt]
        start = time.perf_counter()
        run(cmd, tree, os.path.join(work, f"{name}.log"), args.timeout)
        seconds = time.perf_counter() - start
        ranks = []
        for r in range(world):
            out = os.path.join(work, f"{name}.json" if world == 1 else f"{name}.rank-{r}.json")
            folder = ckpt if world == 1 else os.path.join(ckpt, f"rank-{r}-of-{world}")
            with open(out) as f:
                result = json.load(f)
            files = sorted(glob.glob(os.path.join(folder, "checkpoint-*.pt")))
            if not files:
                raise RuntimeError(f"{name}: no checkpoint in {folder}")
            ranks.append({"final_loss": result["final_loss"], "steps": result["steps"], "checkpoint": files[-1],
                          "samples_per_s": result.get("samples_per_s")})
        results[name] = {"command": " ".join(cmd[1:]), "seconds": seconds, "ranks": ranks}
    return results


def flatten(value, prefix: str = "") -> dict:
    """{"a.b.0": leaf} of nested dicts, lists and tuples."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return {prefix: value}
    out = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def first_difference(ref: dict, other: dict) -> tuple[int, str | None]:
    """(entries compared, the first entry that differs or is missing on one side)."""
    for name in ref:
        if name not in other:
            return len(ref), f"{name} (only in the reference)"
        if not same(ref[name], other[name]):
            a, b = ref[name], other[name]
            if torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype:
                diff = (a.double() - b.double()).abs()
                return len(ref), (f"{name} ({int((a != b).sum())} of {a.numel()} elements differ, "
                                  f"max abs diff {float(diff.max()):.3g})")
            return len(ref), f"{name} ({_short(a)} vs {_short(b)})"
    extra = [name for name in other if name not in ref]
    return len(ref), (f"{extra[0]} (only in the compared tree)" if extra else None)


def _short(value) -> str:
    if torch.is_tensor(value):
        return f"tensor {tuple(value.shape)} {value.dtype}"
    return repr(value)[:60]


def compare(ref: dict, other: dict) -> dict:
    """One tree's runs against the reference's: losses, model state, the rest of the checkpoint."""
    out = {}
    for name, ref_run in ref.items():
        ranks = []
        for r, (a, b) in enumerate(zip(ref_run["ranks"], other[name]["ranks"])):
            ca = torch.load(a["checkpoint"], map_location="cpu", weights_only=True)
            cb = torch.load(b["checkpoint"], map_location="cpu", weights_only=True)
            n_model, model_diff = first_difference(flatten(ca.get("model", {})), flatten(cb.get("model", {})))
            rest = lambda c: {k: v for k, v in flatten({k: v for k, v in c.items() if k != "model"}).items()  # noqa: E731
                              if torch.is_tensor(v)}
            n_rest, rest_diff = first_difference(rest(ca), rest(cb))
            loss_equal = same(float(a["final_loss"]), float(b["final_loss"]))
            ranks.append({"rank": r, "loss_equal": loss_equal, "model_entries": n_model,
                          "model_first_difference": model_diff, "model_equal": model_diff is None,
                          "other_tensors": n_rest, "other_first_difference": rest_diff,
                          "steps_equal": a["steps"] == b["steps"]})
        out[name] = ranks
    return out


def parse_trees(values: list[str]) -> list[tuple[str, str]]:
    """[(label, path)] from PATH or LABEL=PATH; a path given twice gets #2."""
    trees, seen = [], {}
    for v in values:
        label, path = v.split("=", 1) if "=" in v and not os.path.exists(v) else (v, v)
        path = os.path.abspath(path)
        seen[label] = seen.get(label, 0) + 1
        trees.append((label if seen[label] == 1 else f"{label}#{seen[label]}", path))
    return trees


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, metavar="[LABEL=]PATH",
                        help="a source tree with deeprec/_C built in place; the first is the reference")
    parser.add_argument("--runs", nargs="+", choices=("local", "collective"), default=["local", "collective"])
    parser.add_argument("--steps", type=int, default=300, help="steps of the local run (default: 300)")
    parser.add_argument("--batch-size", type=int, default=512, help="local run (default: 512)")
    parser.add_argument("--collective-steps", type=int, default=300, help="(default: 300)")
    parser.add_argument("--collective-batch-size", type=int, default=64, help="per rank (default: 64)")
    parser.add_argument("--synthetic", type=int, metavar="ROWS",
                        help="train on ROWS synthetic Criteo rows (deeprec train --synthetic) instead of the "
                             "bundled sample")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per run (default: 1200)")
    parser.add_argument("--keep", metavar="DIR", help="keep logs, JSON and checkpoints in DIR")
    parser.add_argument("--out", default=os.path.join(RESULTS, "equivalence.json"))
    args = parser.parse_args()

    trees = parse_trees(args.tree)
    work = args.keep or tempfile.mkdtemp(prefix="deeprec-equivalence-")
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpu_model": cpu_model(), "cpus": os.cpu_count(),
              "torch": torch.__version__, "python": platform.python_version(), "python_executable": sys.executable,
              "settings": {k: getattr(args, k) for k in ("runs", "steps", "batch_size", "collective_steps",
                                                         "collective_batch_size", "synthetic")},
              "trees": {}, "comparisons": {}}
    status = 0
    try:
        results = {}
        for label, path in trees:
            print(f"{label}: {path}", flush=True)
            folder = os.path.join(work, f"tree{len(results)}")
            os.makedirs(folder, exist_ok=True)
            try:
                info = describe(path)
                results[label] = train_runs(path, folder, args)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"FAILED: {e}", file=sys.stderr)
                report["trees"][label] = {"path": path, "error": str(e)[-3000:]}
                status = 2
                continue
            report["trees"][label] = {**info, "runs": results[label]}
        ref_label = trees[0][0]
        for label, _ in trees[1:]:
            if ref_label in results and label in results:
                report["comparisons"][label] = compare(results[ref_label], results[label])

        print(f"\n{report['cpu_model']}, {report['cpus']} cores, torch {report['torch']}, CPU fp32, 1 thread")
        header = f"{'tree':<28} {'run':<11} {'rank':>4} {'steps':>5} {'final loss':>24}  {'vs ' + ref_label}"
        print(header + "\n" + "-" * len(header))
        for label, runs in results.items():
            for name, res in runs.items():
                for r, rank in enumerate(res["ranks"]):
                    verdict = ""
                    if label in report["comparisons"]:
                        c = report["comparisons"][label][name][r]
                        verdict = "equal" if c["loss_equal"] and c["model_equal"] else "DIFFERS"
                    print(f"{label[:28]:<28} {name:<11} {r:>4} {rank['steps']:>5} {rank['final_loss']!r:>24}  {verdict}")
        for label, comparison in report["comparisons"].items():
            firsts = [f"{name} rank {c['rank']}: " + ("final loss" if not c["loss_equal"] else "")
                      + ("" if c["loss_equal"] or c["model_equal"] else ", ")
                      + (c["model_first_difference"] or "")
                      for name, ranks in comparison.items() for c in ranks if not (c["loss_equal"] and c["model_equal"])]
            equal = not firsts
            report["comparisons"][label] = {"bitwise_equal": equal, "first_difference": firsts[0] if firsts else None,
                                            "runs": comparison}
            print(f"\n{label} vs {ref_label}: bitwise equal: {'yes' if equal else 'no'}"
                  + ("" if equal else f" (first difference: {firsts[0]})"))
            for name, ranks in comparison.items():
                for c in ranks:
                    other = ("equal" if c["other_first_difference"] is None
                             else f"differ at {c['other_first_difference']}")
                    print(f"  {name} rank {c['rank']}: loss {'equal' if c['loss_equal'] else 'DIFFERS'}, "
                          f"{c['model_entries']} model entries {'equal' if c['model_equal'] else 'DIFFER'}; "
                          f"other checkpoint tensors ({c['other_tensors']}, optimizer/RNG, not in the verdict): {other}")
            if not equal:
                status = max(status, 1)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print("saved", args.out)
    return status


if __name__ == "__main__":
    sys.exit(main())
