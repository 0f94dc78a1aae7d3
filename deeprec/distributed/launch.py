"""`deeprec launch`: a whole PS job, or a collective job, on one machine (processes on loopback).

    deeprec launch --ps 2 --workers 2 --protocol star_server -- train --model dlrm --synthetic 100000 --steps 200
    deeprec launch --workers 2 --collective -- train --embedding variable --synthetic 100000 --steps 200

--collective starts no PS: the workers are torch.distributed ranks, as under
`torchrun --nproc-per-node N -m deeprec train ...` (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE; OMP_NUM_THREADS = cores / workers unless set), and train
with sharded embeddings (deeprec.distributed.collective.sharded). A rank that fails stops the others
(they would wait for it in their next collective), as torchrun's agent does; with --max-restarts N
the launcher then starts every rank again, up to N times, and each resumes from the worker command's
--checkpoint-dir (deeprec.distributed.collective.elastic).

Starts the PS shards (each prints its port), then the workers with TF_CONFIG set
as a Kubernetes TFJob would, and torch.distributed's MASTER_ADDR, MASTER_PORT, RANK and
WORLD_SIZE as a PyTorchJob would (for `train --dense allreduce`); streams every worker's output prefixed with its
name; exits with the first failing worker's code (the others go on), and stops
the PSs at the end. The job gets its own PS token (DEEPREC_PS_TOKEN, through the
environment). Every process it starts runs in its own session, so a Ctrl-C at the terminal
reaches the launcher alone: SIGTERM or SIGINT to the launcher goes to the workers, which finish
their step and checkpoint (exit 143/130); the PSs stay up for the chief's snapshot and are
stopped once the workers have exited; all of them are reaped before the launcher exits.
Should the launcher itself die (SIGKILL, OOM killer), every process it started gets SIGTERM from
the kernel (Linux PR_SET_PDEATHSIG, set in the child before it runs): no PS is left orphaned.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import secrets
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from deeprec.distributed.ps.client import PROTOCOLS
from deeprec.security import TOKEN_ENV
from deeprec.errors import ConfigError


_PR_SET_PDEATHSIG = 1


def _load_prctl():
    """libc's prctl, resolved here (a child between fork and exec must not load libraries), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_prctl = _load_prctl()


def die_with_parent(sig: int = signal.SIGTERM):
    """A Popen preexec_fn: the child gets `sig` when the process that started it dies, however it dies
    (PR_SET_PDEATHSIG; None where there is no prctl). Combines with start_new_session, which Popen applies first."""
    if _prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the line above: nobody would signal us
            os.kill(os.getpid(), sig)

    return preexec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Lines:
    """The launcher's output: each write (one or more whole lines) goes out in one piece and is
    flushed, under a lock shared by the threads that stream the workers' lines, so that no two
    lines mix, however long."""

    def __init__(self, sink):
        self.sink, self.lock = sink, threading.Lock()

    def write(self, text: str) -> None:
        with self.lock:
            self.sink.write(text)
            self.sink.flush()

    def flush(self) -> None:
        with self.lock:
            self.sink.flush()


def _stream(prefix: str, pipe, sink) -> None:
    """Each whole line the child writes, prefixed (its last line ended here if the child did not)."""
    for line in iter(pipe.readline, ""):
        sink.write(f"[{prefix}] {line}" if line.endswith("\n") else f"[{prefix}] {line}\n")


def launch(num_ps: int | None, num_workers: int, protocol: str, train_args: list[str], sync: bool = False,
           out=sys.stdout, resume: bool = False, collective: bool = False, max_restarts: int = 0) -> int:
    """num_ps None: 1, or none with `collective`. `max_restarts` (collective): restart every rank after
    one fails, as torchrun --max-restarts does (deeprec.distributed.collective.elastic)."""
    if collective and (num_ps or sync):
        raise ConfigError("--collective starts no parameter server: drop --ps and --sync (collective training is "
                          "synchronous)")
    if max_restarts and not collective:
        raise ConfigError("--max-restarts restarts the ranks of a collective job: add --collective (a PS job's "
                          "workers are not restarted)")
    num_ps = 0 if collective else (1 if num_ps is None else num_ps)
    if protocol not in PROTOCOLS:
        raise ConfigError(f"protocol={protocol!r} is not allowed; choose one of {', '.join(PROTOCOLS)}")
    if sync and protocol == "grpc":
        raise ConfigError("--sync needs a fused protocol: star_server or star_server_lite")
    if not train_args or train_args[0] != "train":
        raise ConfigError("give the worker command after --, e.g. -- train --model dlrm --synthetic 100000")
    if (num_ps < 1 and not collective) or num_workers < 1:
        raise ConfigError("--ps and --workers must be >= 1")
    if resume:  # PS job: the chief restores the PSs (any count); collective: each rank reshards
        if "--checkpoint-dir" not in train_args:
            raise ConfigError("--resume needs the worker command's --checkpoint-dir")
        train_args = [*train_args, "--resume"]
    if sync:
        train_args = [*train_args, "--sync"]
    env = dict(os.environ, **{TOKEN_ENV: os.environ.get(TOKEN_ENV) or secrets.token_hex(32)})
    out = _Lines(out)  # whole lines, the launcher's and every worker's
    children = Children()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def forward(signum, frame):
        """Stop the job: the workers get the signal, finish their step and checkpoint (the PSs stay up
        for the chief's snapshot and are stopped once the workers have exited); a second signal reaches
        the workers too, and they exit at once. Before any worker runs, the launcher stops."""
        if not children.workers:
            for proc in children:
                if proc.poll() is None:
                    proc.send_signal(signum)
            raise SystemExit(128 + signum)
        children.stopping = signum
        for proc in children.workers:
            if proc.poll() is None:
                proc.send_signal(signum)

    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        for sig in previous:
            signal.signal(sig, children.handler(forward))
    try:
        if collective:
            return _run_collective(num_workers, train_args, out, env, children, max_restarts)
        return _run(num_ps, num_workers, protocol, train_args, out, env, children)
    finally:
        for proc in children:
            if proc.poll() is None:
                proc.terminate()
        for proc in children:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if in_main:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _run(num_ps: int, num_workers: int, protocol: str, train_args: list[str], out, env: dict,
         children: Children) -> int:
    ps_addresses = []
    for i in range(num_ps):
        proc = children.start([sys.executable, "-m", "deeprec.distributed.ps", "--bind", "127.0.0.1:0", "--shard",
                               str(i), "--num-shards", str(num_ps), "--workers", str(num_workers)],
                              stdout=subprocess.PIPE, text=True, env=env)
        line = proc.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"PS {i} did not start: {line.strip() or 'no output'}")
        ps_addresses.append(line.split()[-1])
        out.write(f"[ps{i}] {line}")
    workers = ["127.0.0.1:0"] * num_workers  # workers serve nothing: placeholder addresses
    cluster = {"ps": ps_addresses, "worker": workers}
    master_port = _free_port()  # torch.distributed's rendezvous (train --dense allreduce)
    return _run_workers([dict(env, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}),
                              DEEPREC_PROTOCOL=protocol, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port),
                              RANK=str(i), WORLD_SIZE=str(num_workers)) for i in range(num_workers)],
                        train_args, out, children)


def _run_collective(num_workers: int, train_args: list[str], out, env: dict, children: Children,
                    max_restarts: int = 0) -> int:
    """torchrun's environment for each rank, on loopback. A rank that fails stops the others; with
    `max_restarts` the launcher then starts every rank again (TORCHELASTIC_RESTART_COUNT = the
    restart), and each resumes from the worker command's --checkpoint-dir."""
    from deeprec.distributed.collective.elastic import (MAX_RESTARTS_ENV, RESTART_ENV, checkpoint_dir_of,
                                                        describe_exit, newest_step)

    threads = env.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // num_workers))  # no oversubscription
    base = checkpoint_dir_of(train_args)
    if max_restarts and base is None:
        out.write(f"[launch] warning: --max-restarts {max_restarts} without the worker command's --checkpoint-dir: "
                  "a restart starts over from step 0\n")
    for restart in range(max_restarts + 1):
        master_port = _free_port()  # a fresh rendezvous per start
        envs = [dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), RANK=str(i),
                     WORLD_SIZE=str(num_workers), LOCAL_RANK=str(i), LOCAL_WORLD_SIZE=str(num_workers),
                     OMP_NUM_THREADS=threads, **{RESTART_ENV: str(restart), MAX_RESTARTS_ENV: str(max_restarts)})
                for i in range(num_workers)]
        code = _run_workers(envs, train_args, out, children, all_or_none=True,
                            then="restarting every rank" if restart < max_restarts else "restart it with --resume")
        if code == 0 or children.stopping is not None or children.failure is None:
            return code
        rank, failed = children.failure
        if restart == max_restarts:
            if max_restarts:
                out.write(f"[launch] restarts exhausted (--max-restarts {max_restarts}): rank {rank} exited with "
                          f"{describe_exit(failed)} on restart {restart}; the job failed\n")
            return code
        step = newest_step(base, num_workers)
        since = (f"resuming every rank from the checkpoint of step {step}" if step is not None else
                 f"no checkpoint in {base}: every rank starts over from step 0" if base else
                 "no --checkpoint-dir: every rank starts over from step 0")
        out.write(f"[launch] restart {restart + 1} of {max_restarts}: rank {rank} exited with "
                  f"{describe_exit(failed)}; {since}\n")
        out.flush()
    return code


class Children(list):
    """Every process the launcher started (PSs first), in their own sessions: a Ctrl-C at the terminal
    reaches the launcher alone, which forwards it to the workers (the PSs must outlive the chief's last
    checkpoint). `stopping`: the signal the launcher forwarded, if any."""

    def __init__(self):
        super().__init__()
        self.workers: list[subprocess.Popen] = []
        self.stopping: int | None = None
        self.failure: tuple[int, int] | None = None  # (rank, exit code) of the last start's first failure
        self.starting, self.deferred, self.on_signal = False, [], None

    def handler(self, on_signal):
        """`on_signal` as a signal handler that waits, while a child starts, until it is recorded."""
        self.on_signal = on_signal

        def handle(signum, frame):
            if self.starting:  # between the child's fork and its record: act once it is recorded
                self.deferred.append(signum)
            else:
                on_signal(signum, frame)
        return handle

    def start(self, argv: list[str], worker: bool = False, **popen) -> subprocess.Popen:
        """A child started in its own session, with PR_SET_PDEATHSIG, and recorded. A SIGTERM or SIGINT
        that lands while it starts (its handler runs between two bytecodes of the start) is acted on once
        the child is recorded, else the stop would miss it and the child outlive the launcher; a worker
        started after a stop gets the stop's signal."""
        stopping = self.stopping
        self.starting = True
        try:
            proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=die_with_parent(), **popen)
            self.append(proc)
            if worker:
                self.workers.append(proc)
                if stopping is not None:
                    proc.send_signal(stopping)
        finally:
            self.starting = False
            deferred, self.deferred = self.deferred, []
            for signum in deferred:  # in order: a second one makes the workers exit at once
                self.on_signal(signum, None)  # may raise SystemExit: recorded children are reaped
        return proc


def _run_workers(envs: list[dict], train_args: list[str], out, children: Children, all_or_none: bool = False,
                 then: str = "restart it with --resume") -> int:
    """One `deeprec train` per environment; output prefixed; the first failure's exit code.
    `all_or_none` (collective): the first rank that fails stops the others, which would otherwise
    wait in their next collective for it (as torchrun's agent does); `then`: what happens next."""
    procs, children.failure = [], None
    results = tempfile.mkdtemp(prefix="deeprec-launch-")  # each worker's result JSON: the job's totals
    for i, worker_env in enumerate(envs):
        proc = children.start([sys.executable, "-m", "deeprec.cli", *train_args], worker=True,
                              env=dict(worker_env, DEEPREC_LAUNCHED="1", DEEPREC_RESULT_DIR=results),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        thread = threading.Thread(target=_stream, args=(f"worker{i}", proc.stdout, out), daemon=True)
        thread.start()
        procs.append((proc, thread))
    codes: dict[int, int] = {}
    first_failure = None
    while len(codes) < len(procs):
        for i, (proc, thread) in enumerate(procs):
            if i in codes or proc.poll() is None:
                continue
            codes[i] = proc.returncode
            thread.join(10)
            if children.stopping is not None and codes[i] == 128 + children.stopping:
                out.write(f"[launch] worker{i} stopped on {signal.Signals(children.stopping).name} "
                          "(its checkpoint written)\n")
                first_failure = i if first_failure is None else first_failure  # the job's exit code: 130/143
                continue
            if codes[i] != 0 and first_failure is None:
                first_failure, children.failure = i, (i, codes[i])
                out.write(f"[launch] worker{i} failed with exit code {codes[i]}\n")
                if all_or_none:
                    out.write(f"[launch] stopping the other ranks: a collective job needs every rank ({then})\n")
                    for other, _ in procs:  # killed: their step waits for the failed rank and never ends,
                        if other.poll() is None:  # so SIGTERM's finish-the-step-and-checkpoint cannot apply
                            other.kill()
            elif codes[i] != 0 and not all_or_none:
                out.write(f"[launch] worker{i} failed with exit code {codes[i]}\n")
        time.sleep(0.05)
    failed = [codes[i] for i in sorted(codes) if codes[i] != 0]
    if children.stopping is not None:
        out.write(f"[launch] job stopped on {signal.Signals(children.stopping).name}; continue it with --resume\n")
    out.write(f"[launch] {len(codes) - len(failed)}/{len(codes)} workers succeeded\n")
    totals = job_totals(results)
    shutil.rmtree(results, ignore_errors=True)
    if totals:
        out.write(f"[launch] {totals}\n")
    return codes[first_failure] if first_failure is not None else 0


def job_totals(folder: str) -> str | None:
    """One line of the job's totals from the workers' result files (JSON, written by deeprec train)."""
    results = []
    for name in sorted(os.listdir(folder)):
        try:
            with open(os.path.join(folder, name)) as f:
                results.append(json.load(f))
        except (OSError, ValueError):
            continue
    if not results:
        return None
    rows = sum(r["rows"] for r in results)
    seconds = max(r["seconds"] for r in results)
    line = (f"job: {len(results)} workers, {max(r['steps'] for r in results)} steps, {rows:,} rows, "
            f"{rows / seconds if seconds > 0 else 0.0:,.0f} samples/s in all")
    evaluated = [r["eval"] for r in results if "eval" in r]
    if evaluated and len(evaluated) == 1:
        line += f", eval AUC {evaluated[0]['auc']:.4f} ({evaluated[0]['rows']:,} rows)"
    elif evaluated:  # collective: every rank holds the whole job's metrics
        line += f", eval AUC {evaluated[0]['auc']:.4f} ({evaluated[0]['rows']:,} rows, all ranks)"
    return line
