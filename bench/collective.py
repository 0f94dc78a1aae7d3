"""Collective training (sharded embeddings by all-to-all, dense by all-reduce) against one
process and against PS training, side by side: DLRM, batch 512 per rank, EmbeddingVariables,
Adagrad, synthetic Criteo-layout data (Kaggle cardinalities). Each configuration is one
`deeprec train` job of real processes (`deeprec launch`); rounds interleave the configurations.

    1 rank, 2 threads     local training: all of this machine's cores in one process
    1 rank, 1 thread      local training on one core (the per-core reference)
    2 ranks collective    deeprec launch --workers 2 --collective, 1 thread each
    2 workers + 1 PS      deeprec launch --ps 1 --workers 2 (dense by all-reduce), 1 thread each:
                          asynchronous (each worker's step reads rows the other may be updating)
    ... , sync            the same with --sync: every step averages both workers' gradients, as
                          collective training does (the same math)

Reported: aggregate steady samples/s (sum over ranks, after the trainer's 50 warm-up steps),
median over rounds; per rank and step, the time inside the all-to-alls (ids, rows,
gradients) and the dense all-reduce (waiting for the other rank included) and the bytes
each sends. Then the projection to 8 and 64 ranks on a 25 Gb/s network from the measured
volume, with the arithmetic printed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _common import cpu_line, print_table, save_figure, save_json, synthetic_criteo

BATCH = 512
CONFIGS = {
    "1 rank, 2 threads": ([], ["--threads", "2"]),
    "1 rank, 1 thread": ([], ["--threads", "1"]),
    "2 ranks collective": (["launch", "--workers", "2", "--collective", "--"], ["--threads", "1"]),
    "2 workers + 1 PS": (["launch", "--ps", "1", "--workers", "2", "--"], ["--threads", "1"]),
    "2 workers + 1 PS, sync": (["launch", "--ps", "1", "--workers", "2", "--sync", "--"], ["--threads", "1"]),
}
LINK_GBPS = 25.0
MESSAGE_LATENCY_S = 25e-6  # assumed per message on TCP (not measured here): ring all-reduce 2(N-1), all-to-all N-1 x 4


def run(config: str, data: str, steps: int, folder: str) -> dict:
    """One job; its ranks' results summed (samples/s) or averaged (per-rank traffic)."""
    launcher, extra = CONFIGS[config]
    out = os.path.join(folder, f"{config.replace(' ', '_').replace(',', '').replace('+', '')}.json")
    command = [sys.executable, "-m", "deeprec.cli", *launcher, "train", "--model", "dlrm", "--data", data,
               "--embedding", "variable", "--optimizer", "adagrad", "--batch-size", str(BATCH), "--steps",
               str(steps), "--no-progress", "--json", out, *extra]
    env = dict(os.environ, OMP_NUM_THREADS=extra[-1])
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{config} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    stem, ext = os.path.splitext(out)
    paths = [out] if not launcher else [f"{stem}.rank-{r}{ext}" for r in range(2)]
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    row = {"samples_per_s": sum(r["steady_samples_per_s"] for r in results), "ranks": len(results)}
    traffic = [r["communication"] for r in results if "communication" in r]
    if traffic:
        for key in ("all_to_all_ms", "all_to_all_bytes", "all_reduce_ms", "all_reduce_bytes", "dense_parameters"):
            row[key] = statistics.fmean(t[key] for t in traffic)
    return row


def project(measured: dict, compute_ms: float, ranks: int) -> dict:
    """Step time at `ranks` ranks, one per machine with this machine's compute, on a LINK_GBPS link:
    compute + (bytes at N) / bandwidth + messages x latency (no overlap: the exchange is in the step)."""
    n0 = measured["ranks"]
    off_rank = lambda n: (n - 1) / n  # noqa: E731  share of a rank's keys owned by another rank
    a2a_bytes = measured["all_to_all_bytes"] / off_rank(n0) * off_rank(ranks)  # per-rank keys do not grow with N
    ring_bytes = measured["all_reduce_bytes"] / (2 * off_rank(n0)) * 2 * off_rank(ranks)
    seconds = lambda b: b * 8 / (LINK_GBPS * 1e9)  # noqa: E731
    latency = MESSAGE_LATENCY_S * (4 * (ranks - 1) + 2 * (ranks - 1))
    comm_ms = 1e3 * (seconds(a2a_bytes) + seconds(ring_bytes) + latency)
    step_ms = compute_ms + comm_ms
    return {"ranks": ranks, "all_to_all_bytes": a2a_bytes, "all_reduce_bytes": ring_bytes,
            "comm_ms": comm_ms, "step_ms": step_ms, "samples_per_s": ranks * BATCH / step_ms * 1e3,
            "efficiency": compute_ms / step_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from results/collective.json")
    args = parser.parse_args()
    if args.plot_only:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "collective.json")) as f:
            saved = json.load(f)
        plot(saved["median_samples_per_s"], saved["projection"], saved["projection_assumptions"]["compute_ms"])
        return
    data = synthetic_criteo(args.rows)
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            for config in CONFIGS:
                runs[config].append(run(config, data, args.steps, folder))
                print(f"round {r + 1}/{args.rounds} {config}: {runs[config][-1]['samples_per_s']:,.0f} samples/s",
                      flush=True)
    median = {c: statistics.median(x["samples_per_s"] for x in rs) for c, rs in runs.items()}
    base = median["1 rank, 2 threads"]
    rows = []
    for config, rs in runs.items():
        traffic = rs[len(rs) // 2] if "all_to_all_ms" in rs[0] else None
        rows.append([config, f"{median[config]:,.0f}", f"{median[config] / base:.2f}x",
                     f"{statistics.median(x['all_to_all_ms'] for x in rs):.2f}" if traffic else "-",
                     f"{traffic['all_to_all_bytes'] / 1e3:,.0f}" if traffic else "-",
                     f"{statistics.median(x['all_reduce_ms'] for x in rs):.2f}" if traffic else "-",
                     f"{traffic['all_reduce_bytes'] / 1e3:,.0f}" if traffic else "-"])
    print_table(f"DLRM, batch {BATCH} per rank, {args.steps} steps, median of {args.rounds} rounds ({cpu_line()})",
                ["configuration", "samples/s (all ranks)", "vs 1 rank 2 threads", "all-to-all ms/step",
                 "all-to-all kB sent/step", "all-reduce ms/step", "all-reduce kB sent/step"], rows)

    collective = runs["2 ranks collective"][len(runs["2 ranks collective"]) // 2]
    compute_ms = BATCH / median["1 rank, 2 threads"] * 1e3  # one rank with this machine's 2 cores
    projections = [project(collective, compute_ms, n) for n in (2, 8, 64)]
    print(f"\nProjection: one rank per machine like this one (compute {compute_ms:.1f} ms/step, measured), "
          f"{LINK_GBPS:g} Gb/s link, {MESSAGE_LATENCY_S * 1e6:.0f} us per message (assumed).\n"
          f"  all-to-all bytes(N) = {collective['all_to_all_bytes']:,.0f} B measured at 2 ranks / (1/2) x (N-1)/N "
          "(a rank's keys per step do not grow with N; the share owned elsewhere does)\n"
          f"  all-reduce bytes(N) = 2 (N-1)/N x {collective['dense_parameters']:,.0f} params x 4 B (ring)\n"
          "  step(N) = compute + bytes(N) x 8 / 25e9 + 6 (N-1) messages x latency")
    print_table("Projected scaling (arithmetic above)",
                ["ranks", "all-to-all MB/step", "all-reduce MB/step", "comm ms/step", "step ms", "samples/s",
                 "efficiency"],
                [[p["ranks"], f"{p['all_to_all_bytes'] / 1e6:.2f}", f"{p['all_reduce_bytes'] / 1e6:.2f}",
                  f"{p['comm_ms']:.2f}", f"{p['step_ms']:.1f}", f"{p['samples_per_s']:,.0f}",
                  f"{p['efficiency']:.0%}"] for p in projections])
    save_json("collective", {"batch_per_rank": BATCH, "steps": args.steps, "rounds": args.rounds, "rows": args.rows,
                             "runs": runs, "median_samples_per_s": median, "projection": projections,
                             "projection_assumptions": {"link_gbps": LINK_GBPS, "message_latency_s": MESSAGE_LATENCY_S,
                                                        "compute_ms": compute_ms}})

    plot(median, projections, compute_ms)


def plot(median: dict, projections: list[dict], compute_ms: float) -> None:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(range(len(median)), list(median.values()), color=["#888", "#bbb", "#2a7", "#c63", "#e96"])
    left.set_xticks(range(len(median)), [c.replace(", ", "\n").replace(" + ", "\n+ ").replace(" collective", "\ncollective")
                                         for c in median], fontsize=8)
    left.set_ylabel("samples/s, all ranks")
    left.set_title("measured on this machine (2 cores)")
    right.plot([p["ranks"] for p in projections], [p["samples_per_s"] for p in projections], "o-", color="#2a7",
               label="projected")
    right.plot([p["ranks"] for p in projections], [p["ranks"] * BATCH / compute_ms * 1e3 for p in projections], "--",
               color="#888", label="linear")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("ranks (one machine each)")
    right.set_ylabel("samples/s")
    right.set_title(f"projected on {LINK_GBPS:g} Gb/s")
    right.legend()
    save_figure(fig, "collective")


if __name__ == "__main__":
    main()
