"""Parameter-server protocols side by side: 1 PS process, 1 and 2 worker processes.

Each worker step pulls the rows of 26 tables (the step's unique ids, dim 16) and
pushes their gradients. The dense DLRM parameters (~475k floats) either travel too
(dense=ps: pulled and pushed whole) or stay on the workers (dense=allreduce: one
gloo all-reduce of their gradients among the workers per step):

    grpc              Pull + Push per (variable, PS)
    star_server       one fused Pull + one fused Push per PS
    star_server_lite  one PushPull per PS (push of step t with the pull of step t+1)

Ids: "uniform" over 1M per table (most of a step's ids are new to the PS: inserts and
growth dominate; the workload of the earlier rounds of this bench) and "zipf" (s=1.2,
a click log's long tail: mostly known ids, the steady state of a long job).

Communication only (no model compute). Reported: steps/s per worker (median over
workers), bytes per step, PS CPU ms per worker step (from /proc) and the PS's capacity
(1000 / that: worker steps per second one PS core serves).

Then training with compute: DLRM with SmartStage, local vs 1 PS + 1 worker (this
process) with async embedding, dense on the PS and by all-reduce; rounds alternate.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import numpy as np
import torch

from _common import cpu_line, print_table, save_figure, save_json

DENSE_SHAPES = {"bottom.0": (512, 13), "bottom.1": (256, 512), "bottom.2": (64, 256), "bottom.3": (16, 64),
                "top.0": (512, 367), "top.1": (256, 512), "top.2": (1, 256)}


def ps_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker(address: str, ps_pid: int, protocol: str, dense_mode: str, batch: int, steps: int, rank: int,
           workers: int, port: int, ids: str, out) -> None:
    torch.set_num_threads(1)
    from deeprec.distributed import PSClient

    client = PSClient([address], protocol, deadline_s=60)
    client.wait_ready()
    tables = {f"C{i}": 16 for i in range(1, 27)}
    on_ps = dense_mode == "ps"
    client.register(tables, {n: torch.zeros(s) for n, s in DENSE_SHAPES.items()} if on_ps else {},
                    optimizer="adagrad", lr=0.01)
    if not on_ps and workers > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=workers)
    flat = torch.full((sum(a * b for a, b in DENSE_SHAPES.values()),), 1e-3)
    g = torch.Generator().manual_seed(17 + rank)
    rng = np.random.default_rng(17 + rank)

    def draw() -> torch.Tensor:
        if ids == "uniform":  # every id equally likely: most of a step's ids are new to the PS
            return torch.randint(0, 10_000_000, (batch,), generator=g) % 1_000_000
        return torch.from_numpy(np.minimum(rng.zipf(1.2, batch), 1_000_000))  # a click log's long tail

    def keys():
        return {n: torch.unique(draw()) for n in tables}

    dense = list(DENSE_SHAPES) if on_ps else []
    current = keys()
    client.pull(current, dense)
    ps_cpu_start, start = ps_cpu_seconds(ps_pid), time.perf_counter()  # the timed steps only
    for _ in range(steps):
        grads = {n: (k, torch.ones(k.numel(), 16) * 1e-3) for n, k in current.items()}
        if on_ps:
            grads.update({n: torch.ones(s) * 1e-3 for n, s in DENSE_SHAPES.items()})
        elif workers > 1:
            dist.all_reduce(flat)
        nxt = keys()
        if protocol == "star_server_lite":
            client.push_pull(grads, nxt, dense)
        else:
            client.push(grads)
            client.pull(nxt, dense)
        current = nxt
    elapsed, ps_cpu_end = time.perf_counter() - start, ps_cpu_seconds(ps_pid)
    out.put({"steps_per_s": steps / elapsed, "bytes_per_step": (client.bytes_sent + client.bytes_received) / (steps + 1),
             "ps_cpu": (ps_cpu_start, ps_cpu_end)})
    client.close()
    if not on_ps and workers > 1:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(protocol: str, dense_mode: str, workers: int, batch: int, steps: int, ids: str = "uniform") -> dict:
    ps = subprocess.Popen([sys.executable, "-m", "deeprec.distributed.ps", "--bind", "127.0.0.1:0"],
                          stdout=subprocess.PIPE, text=True)
    address = ps.stdout.readline().split()[-1]
    try:
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(address, ps.pid, protocol, dense_mode, batch, steps, w, workers, port,
                                                  ids, out)) for w in range(workers)]
        for p in procs:
            p.start()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(60)
        # from the first worker's first timed step to the last one's end (registration and warm-up excluded)
        cpu = max(r["ps_cpu"][1] for r in results) - min(r["ps_cpu"][0] for r in results)
    finally:
        ps.kill()
        ps.wait(10)
    rates = sorted(r["steps_per_s"] for r in results)
    ms = 1e3 * cpu / (workers * steps)
    return {"steps_per_s_per_worker": rates[len(rates) // 2], "steps_per_s_total": sum(rates),
            "bytes_per_step": results[0]["bytes_per_step"], "ps_cpu_ms_per_step": ms,
            "ps_capacity_steps_per_s": 1e3 / ms}


def run_training(mode: str, steps: int, data: str) -> float:
    """DLRM samples/s: mode "local", "local_tables", or 1 PS + this worker with dense "ps" /
    "allreduce" (star_server), "allreduce_lite" (star_server_lite)."""
    from deeprec.distributed.ps.strategy import ParameterServer
    from deeprec.trainer import TrainConfig, Trainer

    common = dict(model="dlrm", data=[data], steps=steps, batch_size=512, optimizer="adagrad", lr=0.01,
                  progress=False)
    if mode.startswith("local"):
        embedding = "variable" if mode == "local" else None  # None: the default fused hashed tables
        cfg = TrainConfig.create(**common, embedding=embedding, optimize=dict(smart_stage=True, main_threads=1))
        return Trainer(cfg).train()["samples_per_s"]
    ps = subprocess.Popen([sys.executable, "-m", "deeprec.distributed.ps", "--bind", "127.0.0.1:0", "--workers", "1"],
                          stdout=subprocess.PIPE, text=True)
    address = ps.stdout.readline().split()[-1]
    try:
        dense, _, lite = mode.partition("_")
        cfg = TrainConfig.create(**common, dense=dense,
                                 protocol="star_server_lite" if lite else "star_server",
                                 optimize=dict(smart_stage=True, main_threads=1, async_embedding=True))
        return Trainer(cfg, strategy=ParameterServer([address])).train()["samples_per_s"]
    finally:
        ps.kill()
        ps.wait(10)


TRAINING_MODES = {"local": "local (EmbeddingVariables)", "local_tables": "local (hashed tables, the default)",
                  "ps": "1 PS + 1 worker, dense on the PS",
                  "allreduce": "1 PS + 1 worker, dense by all-reduce",
                  "allreduce_lite": "1 PS + 1 worker, dense by all-reduce, star_server_lite"}


def training_section(steps: int, rounds: int) -> dict:
    from _common import summarize, synthetic_criteo

    data = synthetic_criteo(200_000)
    rates = {mode: [] for mode in TRAINING_MODES}
    for _ in range(rounds):
        for mode in TRAINING_MODES:
            rates[mode].append(run_training(mode, steps, data))
    out = {mode: summarize(v) for mode, v in rates.items()}
    local = out["local"]["median"]
    rows = [[label, f"{out[m]['median']:,.0f}", f"{out[m]['median'] / local:.2f}x",
             f"{out[m]['p10']:,.0f}-{out[m]['p90']:,.0f}"] for m, label in TRAINING_MODES.items()]
    print_table(f"DLRM training, SmartStage (+ async embedding on PS), samples/s median of {rounds} - {cpu_line()}",
                ["setup", "samples/s", "vs local", "p10-p90"], rows)
    return {**out, "vs_local": {m: out[m]["median"] / local for m in TRAINING_MODES}, "steps": steps,
            "rounds": rounds}


U, Z = "uniform", "zipf"
CASES = [("grpc", "ps", 1, 512, U), ("star_server", "ps", 1, 512, U), ("star_server_lite", "ps", 1, 512, U),
         ("star_server", "allreduce", 1, 512, U), ("star_server_lite", "allreduce", 1, 512, U),
         ("grpc", "ps", 2, 512, U), ("star_server", "ps", 2, 512, U), ("star_server_lite", "ps", 2, 512, U),
         ("star_server", "allreduce", 2, 512, U), ("star_server_lite", "allreduce", 2, 512, U),
         ("star_server", "ps", 1, 512, Z), ("star_server", "allreduce", 1, 512, Z),
         ("star_server", "ps", 1, 4096, U), ("star_server", "allreduce", 1, 4096, U)]


def _median_run(runs: list[dict]) -> dict:
    """The run with the median PS CPU per step (its other numbers come with it), and the spread."""
    ordered = sorted(runs, key=lambda r: r["ps_cpu_ms_per_step"])
    return {**ordered[len(ordered) // 2], "ps_cpu_ms_all": [r["ps_cpu_ms_per_step"] for r in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--training-steps", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only-training", action="store_true")
    parser.add_argument("--only-cases", action="store_true", help="keep results/ps.json's training section")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each communication case (median)")
    args = parser.parse_args()
    if args.only_cases:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "ps.json")) as f:
            training = json.load(f)["training"]
    else:
        training = training_section(args.training_steps, args.rounds)
    if args.only_training:
        print("saved", save_json("ps_training", training))
        return
    results, rows = {}, []
    runs = {case: [] for case in CASES}
    for _ in range(args.repeats):  # interleaved: each case once per round
        for case in CASES:
            protocol, dense_mode, workers, batch, ids = case
            runs[case].append(run_case(protocol, dense_mode, workers, batch,
                                       args.steps if batch == 512 else max(10, args.steps // 4), ids))
    for case in CASES:
        protocol, dense_mode, workers, batch, ids = case
        r = _median_run(runs[case])
        key = f"{protocol}/{dense_mode}/batch{batch}/workers{workers}/{ids}"
        results[key] = r
        base = results.get(f"star_server/{dense_mode}/batch{batch}/workers{workers}/{ids}",
                           r)["steps_per_s_per_worker"]
        rows.append([str(batch), str(workers), ids, dense_mode, protocol, f"{r['steps_per_s_per_worker']:.1f}",
                     f"{r['steps_per_s_total']:.1f}", f"{r['steps_per_s_per_worker'] / base:.2f}x",
                     f"{r['bytes_per_step'] / 1e6:.2f}", f"{r['ps_cpu_ms_per_step']:.1f}",
                     f"{r['ps_capacity_steps_per_s']:.0f}"])
    print_table(f"parameter server, 1 PS, loopback, communication only - {cpu_line()}",
                ["batch", "workers", "ids", "dense", "protocol", "steps/s per worker", "steps/s total", "vs star_server",
                 "MB/step", "PS CPU ms/step", "PS capacity steps/s"], rows)
    print("saved", save_json("ps", {"steps": args.steps, "results": results,
                                    "training": training}))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.5))
    labels = [f"{p}\n{d} w{w} {i}" + (f" b{b}" if b != 512 else "") for p, d, w, b, i in CASES]
    keys = [f"{p}/{d}/batch{b}/workers{w}/{i}" for p, d, w, b, i in CASES]
    left.bar(range(len(CASES)), [results[k]["ps_cpu_ms_per_step"] for k in keys], color="tab:red")
    left.set_xticks(range(len(CASES)), labels, rotation=90, fontsize=6)
    left.set_ylabel("PS CPU ms per worker step")
    right.bar(range(len(TRAINING_MODES)), [training[m]["median"] for m in TRAINING_MODES], color="tab:blue")
    right.set_xticks(range(len(TRAINING_MODES)), list(TRAINING_MODES), fontsize=8)
    right.set_ylabel("DLRM training samples/s")
    fig.tight_layout()
    save_figure(fig, "ps")


if __name__ == "__main__":
    main()
