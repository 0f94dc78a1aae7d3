"""PS shard CPU per worker step, one case of bench/ps.py: uniform ids, hybrid (dense by all-reduce).

    grpc      bench/ps.py's case star_server/allreduce/batch512/workers1/uniform: 1 PS process,
              1 worker pulling and pushing 26 tables (dim 16, adagrad); PS CPU from /proc
    inproc    the same requests (wire messages as the client packs them) run on a ShardState in
              this process: unpack, pull / push, pack the reply; CPU by time.process_time
              (--profile: cProfile of it, top functions by own time)

The gRPC number is issue 38's "PS shard, uniform ids, hybrid" (goal: <= 4 ms CPU per step);
inproc shows how much of it is the shard's own work (the rest is gRPC and the Python server).

--before DIR measures another checkout of deeprec (its C++ extension built in place, e.g. a
`git worktree` of the commit before a change) in the same run, its rounds alternating with this
tree's, so that both see the same load on a shared machine. Writes results/ps_shard_cpu.json
(--save), a table and results/ps_shard_cpu.png.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_line, print_table, save_figure, save_json  # noqa: E402

TABLES = [f"C{i}" for i in range(1, 27)]
DIM = 16


def _keys(g: torch.Generator, batch: int) -> list[torch.Tensor]:
    """bench/ps.py's uniform draw: each table's unique ids of a batch over 1M."""
    return [torch.unique(torch.randint(0, 10_000_000, (batch,), generator=g) % 1_000_000) for _ in TABLES]


def _messages(keys: list[torch.Tensor], seq: int, pulled: int | None = None) -> tuple[bytes, bytes]:
    """(Push of these keys' gradients, Pull of them) as PSClient packs them for one PS: a push of the
    keys of the client's last pull (seq `pulled`) sends none of them."""
    from deeprec.distributed.ps.wire import pack

    flat, counts = torch.cat(keys), torch.tensor([k.numel() for k in keys])
    common = {"client": "bench", "done": seq - 1, "expect": ["x", 0]}
    grads = {"grads/16": torch.full((flat.numel(), DIM), 1e-3)}
    if pulled is None:
        push = pack({"dense": [], "embeddings": TABLES, **common, "seq": seq}, {"keys": flat, "counts": counts, **grads})
    else:
        push = pack({"dense": [], "embeddings": TABLES, **common, "seq": seq, "pulled": pulled}, grads)
    pull = pack({"train": True, "embeddings": TABLES, "dense": [], **common, "seq": seq + 1},
                {"keys": flat, "counts": counts})
    return push, pull


def inproc(steps: int, batch: int, profile: bool) -> dict:
    """CPU ms per step of the shard's own work on the bench's requests (no gRPC)."""
    from deeprec.distributed.ps.state import ShardState
    from deeprec.distributed.ps.wire import pack, unpack

    torch.set_num_threads(1)  # as the PS process (shard.py)
    state = ShardState(0, 1)
    state.register({"variables": [{"name": n, "kind": "embedding", "dim": DIM, "optimizer": "adagrad", "lr": 0.01}
                                  for n in TABLES]}, {})
    g = torch.Generator().manual_seed(17)
    current = _keys(g, batch)
    _, first = _messages(current, 1)
    state.pull_reply(*unpack(first))
    messages = []
    keyless = importlib.util.find_spec("deeprec.distributed.ps.pulled") is not None  # --before: an older checkout
    for step in range(steps):  # drawn and packed beforehand: the client's work, not the shard's
        nxt = _keys(g, batch)  # step s pushes with seq 2 + 2s, pulls with 3 + 2s (the first pull: 2)
        pulled = (2 + 2 * step - 1 if step else 2) if keyless else None
        messages.append(_messages(current, 2 + 2 * step, pulled)[:1]
                        + _messages(nxt, 2 + 2 * step)[1:])
        current = nxt

    def run():
        for push, pull in messages:
            state.push(*unpack(push))
            pack({}, {})
            pack(*state.pull_reply(*unpack(pull)))

    profiler = cProfile.Profile(time.process_time) if profile else None  # CPU, not wall: a shared machine
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
    if profiler:
        profiler.runcall(run)
    else:
        run()
    ms, after = 1e3 * (time.process_time() - start) / steps, resource.getrusage(resource.RUSAGE_SELF)
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return {"ps_cpu_ms_per_step": ms, "sys_ms_per_step": 1e3 * (after.ru_stime - before.ru_stime) / steps,
            "page_faults_per_step": (after.ru_minflt - before.ru_minflt) / steps,
            "rows": state.arenas[next(iter(state.arenas))].size}


def grpc_case(steps: int, batch: int) -> dict:
    import ps

    return ps.run_case("star_server", "allreduce", 1, batch, steps, "uniform")


def measure(mode: str, steps: int, batch: int) -> float:
    return (grpc_case(steps, batch) if mode == "grpc" else inproc(steps, batch, False))["ps_cpu_ms_per_step"]


def measure_checkout(tree: str, mode: str, steps: int, batch: int) -> float:
    """One run of `mode` with the deeprec of checkout `tree` (run from it: the PS's `python -m` imports from there)."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--mode", mode, "--steps", str(steps), "--batch",
                          str(batch), "--one"], cwd=tree, env={**os.environ, "PYTHONPATH": tree},
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["grpc", "inproc", "both"], default="both")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="inproc: print cProfile's top functions")
    parser.add_argument("--before", metavar="DIR", help="another checkout of deeprec, measured in the same run "
                                                        "(rounds alternating): the 'before' entry")
    parser.add_argument("--before-label", default="before", help="the JSON entry --before's numbers go under")
    parser.add_argument("--save", action="store_true", help="write results/ps_shard_cpu.json")
    parser.add_argument("--label", default="after", help="the JSON entry these numbers go under")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # one run, a JSON line (--before's child)
    args = parser.parse_args()
    modes = ["grpc", "inproc"] if args.mode == "both" else [args.mode]
    if args.one:
        print(json.dumps({"ms": measure(modes[0], args.steps, args.batch)}))
        return
    if args.profile:
        inproc(args.steps, args.batch, True)
    runs = {label: {mode: [] for mode in modes} for label in ([args.before_label] if args.before else []) + [args.label]}
    for _ in range(args.repeats):
        for mode in modes:
            if args.before:
                runs[args.before_label][mode].append(measure_checkout(args.before, mode, args.steps, args.batch))
            runs[args.label][mode].append(measure(mode, args.steps, args.batch))
    out = {label: {mode: {"median_ms": statistics.median(r), "runs_ms": r} for mode, r in by_mode.items()}
           for label, by_mode in runs.items()}
    rows = [[f"{label} ({mode})", f"{o['median_ms']:.2f}", ", ".join(f"{x:.2f}" for x in o["runs_ms"])]
            for label, by_mode in out.items() for mode, o in by_mode.items()]
    print_table(f"PS CPU ms per worker step, uniform ids, batch {args.batch}, {args.steps} steps - {cpu_line()}",
                ["", "median ms", "runs"], rows)
    if args.save:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "ps_shard_cpu.json")
        previous = json.load(open(path)) if os.path.exists(path) else {}
        entries = {k: v for k, v in previous.items() if k != "machine"}
        stamp = {"steps": args.steps, "batch": args.batch, "cpu": cpu_line(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        for label, by_mode in out.items():
            entries[label] = {**by_mode, **stamp, **({"checkout": args.before, "alternating": True}
                                                      if label == args.before_label and args.before else {})}
        print("saved", save_json("ps_shard_cpu", entries))
        plot(entries, list(out), args.batch)


def plot(entries: dict, labels: list[str], batch: int) -> None:
    """results/ps_shard_cpu.png: the medians of this run's entries, by mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        values = [entries[label].get(m, {}).get("median_ms", 0) for m in ("grpc", "inproc")]
        bars = ax.bar([j + i * width for j in range(2)], values, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.axhline(4.0, color="gray", linestyle="--", linewidth=1, label="goal (gRPC): 4 ms")
    ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(2)], ["over gRPC (PS process)", "in-process shard"])
    ax.set_ylabel("PS CPU ms per worker step")
    ax.set_title(f"PS shard, uniform ids, batch {batch}: {cpu_line()}", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, "ps_shard_cpu")


if __name__ == "__main__":
    main()
