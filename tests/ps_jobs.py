"""PS jobs across the hosts of tests/cluster.py, for the fault tests of issue 28 (partition, PS
restart) and bench/faults_ps.py: start PS shards and workers in hosts, read the job's final state.

Every process runs with one thread; the data is a small synthetic file, so a job of a few
hundred steps takes tens of seconds on a loaded machine.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import torch

from deeprec.checkpoint import latest_checkpoint, load_checkpoint

PORT = 7070
SMALL = ["--model", "dlrm", "--batch-size", "32", "--optimizer", "adagrad", "--lr", "0.05", "--seed", "3",
         "--threads", "1", "--no-progress", "--no-smart-stage", "--dense", "ps"]
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def write_data(folder) -> str:
    from deeprec.data import write_synthetic

    path = os.path.join(str(folder), "train.tsv")
    if not os.path.exists(path):
        write_synthetic(path, 40_000, cardinalities="small", seed=1)
    return path


def start_ps(host, shard: int, num_shards: int, name: str | None = None):
    """A PS shard listening on the host's address, port PORT; returns its Proc once it listens."""
    proc = host.run([sys.executable, "-m", "deeprec.distributed.ps", "--bind", f"{host.address}:{PORT}", "--shard",
                     str(shard), "--num-shards", str(num_shards), "--threads", "4"], name=name or f"ps{shard}",
                    env=ENV)
    proc.wait_for("listening on", 60)
    return proc


def start_worker(host, ps_hosts: list, index: int, num_workers: int, args: list[str], name: str | None = None):
    """`deeprec train` as worker `index` of `num_workers`, TF_CONFIG naming the PS hosts."""
    cluster = {"ps": [f"{h.address}:{PORT}" for h in ps_hosts], "worker": ["0.0.0.0:0"] * num_workers}
    env = {**ENV, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})}
    return host.run([sys.executable, "-m", "deeprec", "train", *SMALL, *args], name=name or f"worker{index}", env=env)


def final_state(folder: str) -> dict:
    """The chief's newest checkpoint in `folder`: {"step", "ps": every PS's rows, "model": dense}."""
    path = latest_checkpoint(folder)
    assert path is not None, f"no checkpoint in {folder}: {os.listdir(folder) if os.path.isdir(folder) else None}"
    return load_checkpoint(path)


def differences(a: dict, b: dict) -> list[str]:
    """Where two chief checkpoints differ (rows compared key by key, exactly): [] when equal."""
    out = [] if a["step"] == b["step"] else [f"step {a['step']} != {b['step']}"]
    pa, pb = a["ps"], b["ps"]
    if pa.keys() != pb.keys():
        return out + [f"PS keys differ: {sorted(set(pa) ^ set(pb))[:5]}"]
    for key in sorted(pa):
        x, y = pa[key], pb[key]
        if key.startswith("emb/") and not key.endswith("/global_step"):
            prefix = key.rpartition("/")[0]
            x, y = x[torch.argsort(pa[f"{prefix}/keys"])], y[torch.argsort(pb[f"{prefix}/keys"])]
        if x.shape != y.shape or not torch.equal(x, y):
            out.append(f"{key}: max diff {(x.float() - y.float()).abs().max() if x.shape == y.shape else 'shape'}")
    for key, value in a["model"].items():
        if not torch.equal(value, b["model"][key]):
            out.append(f"model {key}")
    return out


def copy_checkpoint(source: str, step: int, target: str) -> None:
    """The chief's checkpoint of `step` (and each worker-i's of it) into a fresh folder, to --resume from."""
    os.makedirs(target, exist_ok=True)
    for root, _, files in os.walk(source):
        rel = os.path.relpath(root, source)
        for name in files:
            if f"{step:09d}" in name:
                os.makedirs(os.path.join(target, rel), exist_ok=True)
                shutil.copy2(os.path.join(root, name), os.path.join(target, rel, name))
