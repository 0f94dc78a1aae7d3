"""Collective-training faults of issue 28, measured once each (2 ranks, synthetic data, 200 steps,
a checkpoint every 50):

    elastic (fault 3):   `torchrun --max-restarts 2`, rank 1 SIGKILLed just after checkpoint 50;
                         the agent restarts both ranks, which resume from the checkpoint by themselves
    partition (fault 4): ranks on two hosts (network namespaces, tests/cluster.py: needs root), rank 1's
                         link cut just after checkpoint 50 for longer than --collective-timeout 10;
                         both ranks exit, then the link is back and both run again with --resume

Each fault gives {"fault", "detect_s": the kill / cut -> the first log line saying so (the agent's
or a rank's), "recover_s": that line (elastic) / the link back (partition) -> the first step trained
after the restart, "steps_redone": steps done between the checkpoint and the fault (done again; from
the step a rank's error names), "rows_lost": embedding rows of the final checkpoints missing or
different from an uninterrupted run's (0: nothing lost, nothing applied twice)}.

    python bench/faults_collective.py [WORKDIR]
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path.insert(0, TESTS)

import torch  # noqa: E402

from cluster import Cluster, unavailable  # noqa: E402
from test_elastic import saved  # noqa: E402  (every rank's checkpoint of a step written)

STEPS, EVERY, TIMEOUT_S = 200, 50, 10
TRAIN = ["train", "--synthetic", "4000", "--cardinalities", "small", "--batch-size", "32", "--no-progress",
         "--threads", "1", "--steps", str(STEPS), "--checkpoint-every", str(EVERY)]
ERROR = re.compile(r"error: collective training: rank \d stopped answering.*? gave up on (.+?) of step (\d+)")
INTO_S = 1.0  # the fault lands this long after checkpoint 50 appears: mid-way to the next one


class Lines:
    """Lines from a pipe, each with the monotonic time it arrived."""

    def __init__(self, pipe):
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe) -> None:
        for line in iter(pipe.readline, ""):
            self.lines.append((time.monotonic(), line))

    @property
    def text(self) -> str:
        return "".join(line for _, line in self.lines)

    def first(self, pattern: str) -> float | None:
        return next((t for t, line in self.lines if re.search(pattern, line)), None)


def _flat(text: str) -> str:
    """Consoles wrap long lines: one line per message, prefixes kept where they start it."""
    return " ".join(text.split())


def rows_lost(ckpt: Path, reference: Path) -> int:
    """Embedding rows (every rank's tables) missing from the final checkpoints or different from the reference's."""
    from deeprec.checkpoint import load_checkpoint

    def rows(folder: Path) -> dict:
        out = {}
        for rank in range(2):
            model = load_checkpoint(str(folder / f"rank-{rank}-of-2" / f"checkpoint-{STEPS:09d}.pt"))["model"]
            for name in (k for k in model if k.endswith(".keys")):
                prefix = name[: -len("keys")]
                fields = sorted(k for k in model if k.startswith(prefix) and k != name
                                and isinstance(model[k], torch.Tensor) and model[k].dim() > 0)
                for i, key in enumerate(model[name].tolist()):
                    out[(prefix, key)] = [model[f][i] for f in fields]
        return out

    got, expected = rows(ckpt), rows(reference)
    return sum(1 for k, v in expected.items()
               if k not in got or not all(torch.equal(a, b) for a, b in zip(got[k], v)))


def steps_done(gave_up: re.Match) -> int:
    """The steps the job completed, from a rank's error: "gave up on <what> of step N" (the stop
    agreement comes after step N is applied; every other collective is inside step N)."""
    step = int(gave_up.group(2))
    return step if gave_up.group(1) == "the stop agreement" else step - 1


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.02)


def reference(workdir: Path, env: dict) -> Path:
    ckpt = workdir / "uninterrupted"
    done = subprocess.run([sys.executable, "-m", "deeprec.cli", "launch", "--workers", "2", "--collective", "--",
                           *TRAIN, "--checkpoint-dir", str(ckpt)], capture_output=True, text=True, timeout=600,
                          env=env)
    if done.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed:\n{done.stdout[-3000:]}")
    return ckpt


def elastic(workdir: Path, env: dict, ref: Path) -> dict:
    ckpt = workdir / "elastic"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--max-restarts", "2", "-m", "deeprec", *TRAIN, "--checkpoint-dir", str(ckpt)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = Lines(proc.stdout)
    try:
        _wait(saved(ckpt, EVERY), 300, "checkpoint 50")
        time.sleep(INTO_S)
        from test_collective_timeout import _children_with

        victim = _children_with(proc.pid, RANK="1", TORCHELASTIC_RESTART_COUNT="0")
        os.kill(victim[0], 9)
        killed = time.monotonic()
        if proc.wait(600) != 0:
            raise RuntimeError(f"the elastic job failed:\n{out.text[-3000:]}")
        out.thread.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    detected = min(t for t in (out.first(r"failed \(exitcode: -9\) local_rank: 1"),
                               out.first(r"error: collective training: rank 1 stopped answering")) if t is not None)
    step = int(re.search(r"at step (\d+) \(restart 1", _flat(out.text)).group(1))
    first = out.first(rf"step {step + 1} loss")
    failed_in = ERROR.search(_flat(out.text))  # the surviving rank names the step it gave up in
    return {"fault": "collective_rank_killed_elastic", "detect_s": round(detected - killed, 2),
            "recover_s": round(first - detected, 2),
            "steps_redone": steps_done(failed_in) - step if failed_in else None,
            "rows_lost": rows_lost(ckpt, ref), "resumed_from_step": step}


def partition(workdir: Path, env: dict, ref: Path) -> dict:
    ckpt = workdir / "partition"
    cluster = Cluster(workdir / "cluster-logs")
    try:
        hosts = [cluster.host("node0"), cluster.host("node1")]

        def start(port: int, *extra: str) -> list:
            rendezvous = dict(env, MASTER_ADDR=hosts[0].address, MASTER_PORT=str(port), WORLD_SIZE="2",
                              LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GLOO_SOCKET_IFNAME="eth0")
            argv = [sys.executable, "-m", "deeprec", *TRAIN, "--checkpoint-dir", str(ckpt),
                    "--collective-timeout", str(TIMEOUT_S), *extra]
            return [h.run(argv, name=f"rank{r}-{port}", env=dict(rendezvous, RANK=str(r))) for r, h in enumerate(hosts)]

        ranks = start(29500)
        _wait(saved(ckpt, EVERY), 300, "checkpoint 50")
        time.sleep(INTO_S)
        hosts[1].cut()
        cut = time.monotonic()
        _wait(lambda: any("error: collective training" in p.output() for p in ranks), TIMEOUT_S + 60, "an error line")
        detected = time.monotonic()
        _wait(lambda: all(p.returncode is not None for p in ranks), TIMEOUT_S + 60, "both ranks' exit")
        hosts[1].restore()
        back = time.monotonic()
        resumed = start(29501, "--resume")
        said = lambda: [m for p in resumed for m in [re.search(r"resumed from \S+ at step (\d+)", p.output())] if m]
        _wait(said, 300, "the resume")
        step = int(said()[0].group(1))
        _wait(lambda: any(f"step {step + 1} loss" in p.output() for p in resumed), 300, "the first step")
        first = time.monotonic()
        for p in resumed:
            if p.wait(600) != 0:
                raise RuntimeError(f"{p.name} failed after the resume:\n{p.output()[-3000:]}")
        gave_up = [ERROR.search(_flat(p.output())) for p in ranks]
        fault_step = max((steps_done(m) for m in gave_up if m), default=None)
    finally:
        cluster.close()
    return {"fault": "collective_partition", "detect_s": round(detected - cut, 2), "recover_s": round(first - back, 2),
            "steps_redone": fault_step - step if fault_step is not None else None,
            "rows_lost": rows_lost(ckpt, ref), "resumed_from_step": step, "collective_timeout_s": TIMEOUT_S}


def measure(workdir) -> list[dict]:
    """Faults 3 and 4 once each (see the module's docstring); fault 4 is skipped, with why, without root."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", DEEPREC_CACHE=str(workdir / "cache"), PYTHONUNBUFFERED="1")
    ref = reference(workdir, env)
    results = [elastic(workdir, env, ref)]
    why = unavailable()
    results.append({"fault": "collective_partition", "skipped": why} if why else partition(workdir, env, ref))
    return results


if __name__ == "__main__":
    folder = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="faults-collective-")
    for row in measure(folder):
        print(json.dumps(row))
