"""Parameter-server protocols side by side: 1 PS process, 1 and 2 worker processes.

Each worker step pulls the rows of 26 tables (the step's unique ids) and the
dense DLRM parameters (~475k floats), then pushes their gradients:

    grpc              Pull + Push per (variable, PS)
    star_server       one fused Pull + one fused Push per PS
    star_server_lite  one PushPull per PS (push of step t with the pull of step t+1)

Communication only (no model compute). Reported: steps/s per worker (median over
workers), bytes per step, PS CPU seconds per step (from /proc).

Then training with compute: 1 PS + 1 worker (this process) training DLRM with
SmartStage, star_server, with and without async embedding (the pull of batch t+1
runs in the stage thread while batch t computes); rounds alternate the two.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time

import torch

from _common import save_figure, print_table, save_json

DENSE_SHAPES = {"bottom.0": (512, 13), "bottom.1": (256, 512), "bottom.2": (64, 256), "bottom.3": (16, 64),
                "top.0": (512, 367), "top.1": (256, 512), "top.2": (1, 256)}


def ps_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker(address: str, protocol: str, batch: int, steps: int, seed: int, out) -> None:
    torch.set_num_threads(1)
    from deeprec.distributed import PSClient

    client = PSClient([address], protocol, deadline_s=60)
    client.wait_ready()
    tables = {f"C{i}": 16 for i in range(1, 27)}
    client.register(tables, {n: torch.zeros(s) for n, s in DENSE_SHAPES.items()}, optimizer="adagrad", lr=0.01)
    g = torch.Generator().manual_seed(seed)

    def keys():
        return {n: torch.unique(torch.randint(0, 10_000_000, (batch,), generator=g) % 1_000_000) for n in tables}

    dense = list(DENSE_SHAPES)
    current = keys()
    values = client.pull(current, dense)
    start = time.perf_counter()
    for _ in range(steps):
        grads = {n: (k, torch.ones(k.numel(), 16) * 1e-3) for n, k in current.items()}
        grads.update({n: torch.ones(s) * 1e-3 for n, s in DENSE_SHAPES.items()})
        nxt = keys()
        if protocol == "star_server_lite":
            values = client.push_pull(grads, nxt, dense)
        else:
            client.push(grads)
            values = client.pull(nxt, dense)
        current = nxt
    elapsed = time.perf_counter() - start
    assert values[dense[0]].shape == DENSE_SHAPES[dense[0]]
    out.put({"steps_per_s": steps / elapsed, "bytes_per_step": (client.bytes_sent + client.bytes_received) / (steps + 1)})
    client.close()


def run_case(protocol: str, workers: int, batch: int, steps: int) -> dict:
    ps = subprocess.Popen([sys.executable, "-m", "deeprec.distributed", "--bind", "127.0.0.1:0"],
                          stdout=subprocess.PIPE, text=True)
    address = ps.stdout.readline().split()[-1]
    try:
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        cpu0 = ps_cpu_seconds(ps.pid)
        procs = [ctx.Process(target=worker, args=(address, protocol, batch, steps, 17 + w, out)) for w in range(workers)]
        for p in procs:
            p.start()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(60)
        cpu = ps_cpu_seconds(ps.pid) - cpu0
    finally:
        ps.kill()
        ps.wait(10)
    rates = sorted(r["steps_per_s"] for r in results)
    return {"steps_per_s_per_worker": rates[len(rates) // 2], "steps_per_s_total": sum(rates),
            "bytes_per_step": results[0]["bytes_per_step"],
            "ps_cpu_ms_per_step": 1e3 * cpu / (workers * (steps + 1))}


def run_training(async_embedding: bool, steps: int, data: str) -> float:
    from deeprec.trainer import TrainConfig, Trainer

    ps = subprocess.Popen([sys.executable, "-m", "deeprec.distributed", "--bind", "127.0.0.1:0", "--workers", "1"],
                          stdout=subprocess.PIPE, text=True)
    address = ps.stdout.readline().split()[-1]
    try:
        cfg = TrainConfig.create(model="dlrm", data=[data], steps=steps, batch_size=512, optimizer="adagrad",
                                 lr=0.01, ps_addresses=[address], progress=False,
                                 optimize=dict(smart_stage=True, main_threads=1, async_embedding=async_embedding))
        result = Trainer(cfg).train()
    finally:
        ps.kill()
        ps.wait(10)
    return result["samples_per_s"]


def training_section(steps: int, rounds: int) -> dict:
    from _common import summarize, synthetic_criteo

    data = synthetic_criteo(200_000)
    rates = {False: [], True: []}
    for _ in range(rounds):
        for flag in (False, True):
            rates[flag].append(run_training(flag, steps, data))
    out = {("async" if k else "in_step"): summarize(v) for k, v in rates.items()}
    speedup = out["async"]["median"] / out["in_step"]["median"]
    print_table("DLRM training, 1 PS + 1 worker, SmartStage, star_server (samples/s, median)",
                ["embedding pull", "samples/s", "p10-p90"],
                [["in the step", f"{out['in_step']['median']:,.0f}", f"{out['in_step']['p10']:,.0f}-{out['in_step']['p90']:,.0f}"],
                 ["async (in the prefetch)", f"{out['async']['median']:,.0f} ({speedup:.2f}x)",
                  f"{out['async']['p10']:,.0f}-{out['async']['p90']:,.0f}"]])
    return {**out, "speedup": speedup, "steps": steps, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--training-steps", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only-training", action="store_true")
    args = parser.parse_args()
    training = training_section(args.training_steps, args.rounds)
    if args.only_training:
        print("saved", save_json("ps_training", training))
        return
    cases = [(512, 1), (512, 2), (4096, 1)]
    protocols = ["grpc", "star_server", "star_server_lite"]
    results, rows = {}, []
    for batch, workers in cases:
        for protocol in protocols:
            steps = args.steps if batch == 512 else max(10, args.steps // 4)
            r = run_case(protocol, workers, batch, steps)
            results[f"{protocol}/batch{batch}/workers{workers}"] = r
            base = results.get(f"grpc/batch{batch}/workers{workers}", r)["steps_per_s_per_worker"]
            rows.append([f"{batch}", str(workers), protocol, f"{r['steps_per_s_per_worker']:.1f}",
                         f"{r['steps_per_s_per_worker'] / base:.2f}x", f"{r['bytes_per_step'] / 1e6:.2f}",
                         f"{r['ps_cpu_ms_per_step']:.1f}"])
    print_table("parameter server, 1 PS, loopback (communication only)",
                ["batch", "workers", "protocol", "steps/s per worker", "vs grpc", "MB/step", "PS CPU ms/step"], rows)
    print("saved", save_json("ps", {"steps": args.steps, "results": results, "training": training}))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    labels = [f"b{b} w{w}" for b, w in cases]
    for k, protocol in enumerate(protocols):
        vals = [results[f"{protocol}/batch{b}/workers{w}"]["steps_per_s_per_worker"] for b, w in cases]
        ax.bar([i + 0.27 * k for i in range(len(cases))], vals, width=0.27, label=protocol)
    ax.set_xticks([i + 0.27 for i in range(len(cases))], labels)
    ax.set_ylabel("steps/s per worker")
    ax.legend(fontsize=8)
    save_figure(fig, "ps")


if __name__ == "__main__":
    main()
