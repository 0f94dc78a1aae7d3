"""`deeprec launch`: a whole PS job on one machine (processes on loopback).

    deeprec launch --ps 2 --workers 2 --protocol star_server -- train --model dlrm --synthetic 100000 --steps 200

Starts the PS shards (each prints its port), then the workers with TF_CONFIG set
as a Kubernetes operator would; streams every worker's output prefixed with its
name; exits with the first failing worker's code (the others go on), and stops
the PSs at the end.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from deeprec.distributed.client import PROTOCOLS
from deeprec.errors import ConfigError


def _stream(prefix: str, pipe, sink) -> None:
    for line in iter(pipe.readline, ""):
        sink.write(f"[{prefix}] {line}")
        sink.flush()


def launch(num_ps: int, num_workers: int, protocol: str, train_args: list[str], sync: bool = False,
           out=sys.stdout, resume: bool = False) -> int:
    if protocol not in PROTOCOLS:
        raise ConfigError(f"protocol={protocol!r} is not allowed; choose one of {', '.join(PROTOCOLS)}")
    if sync and protocol == "grpc":
        raise ConfigError("--sync needs a fused protocol: star_server or star_server_lite")
    if not train_args or train_args[0] != "train":
        raise ConfigError("give the worker command after --, e.g. -- train --model dlrm --synthetic 100000")
    if num_ps < 1 or num_workers < 1:
        raise ConfigError("--ps and --workers must be >= 1")
    if resume:  # the chief restores the PSs (any count) from --checkpoint-dir; the others wait for it
        if "--checkpoint-dir" not in train_args:
            raise ConfigError("--resume needs the worker command's --checkpoint-dir")
        train_args = [*train_args, "--resume"]
    if sync:
        train_args = [*train_args, "--sync"]
    ps_procs, ps_addresses = [], []
    try:
        for i in range(num_ps):
            proc = subprocess.Popen([sys.executable, "-m", "deeprec.distributed", "--bind", "127.0.0.1:0",
                                     "--shard", str(i), "--num-shards", str(num_ps), "--workers", str(num_workers)],
                                    stdout=subprocess.PIPE, text=True)
            line = proc.stdout.readline()
            if "listening on" not in line:
                raise RuntimeError(f"PS {i} did not start: {line.strip() or 'no output'}")
            ps_procs.append(proc)
            ps_addresses.append(line.split()[-1])
            out.write(f"[ps{i}] {line}")
        workers = ["127.0.0.1:0"] * num_workers  # workers serve nothing: placeholder addresses
        cluster = {"ps": ps_addresses, "worker": workers}
        procs = []
        for i in range(num_workers):
            env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}),
                       DEEPREC_PROTOCOL=protocol)
            proc = subprocess.Popen([sys.executable, "-m", "deeprec.cli", *train_args], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            thread = threading.Thread(target=_stream, args=(f"worker{i}", proc.stdout, out), daemon=True)
            thread.start()
            procs.append((proc, thread))
        codes = []
        for i, (proc, thread) in enumerate(procs):
            codes.append(proc.wait())
            thread.join(10)
            if codes[-1] != 0:
                out.write(f"[launch] worker{i} failed with exit code {codes[-1]}\n")
        failed = [c for c in codes if c != 0]
        out.write(f"[launch] {len(codes) - len(failed)}/{len(codes)} workers succeeded\n")
        return failed[0] if failed else 0
    finally:
        for proc in ps_procs:
            proc.kill()
            proc.wait(10)
