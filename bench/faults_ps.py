"""Parameter-server faults of issue 28, measured once each in network namespaces (tests/cluster.py):

    partition (async, 1 worker; sync, 2 workers): worker 0's link down 10 s after step 100
    ps_restart (async, 1 worker, 2 PSs):          PS 1 SIGKILLed 2 s after checkpoint 100, started again

Each fault gives {"fault", "detect_s": fault -> the worker's first line saying so, "recover_s": link
back / PS listening again -> training goes on (the "answered again" line of a partition, the
"rolled back" line of a restart), "steps_redone", "rows_lost": embedding rows of the final state
missing or different from the reference (an uninterrupted run; for a restart, one resumed from the
same checkpoint): 0 when no update was lost or applied twice}. Needs root (ip netns).

    python bench/faults_ps.py [WORKDIR]
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path.insert(0, TESTS)

from cluster import Cluster, unavailable  # noqa: E402
from ps_jobs import copy_checkpoint, final_state, start_ps, start_worker, write_data  # noqa: E402

CUT_S = 10.0


def _first(proc, pattern: str, timeout: float) -> tuple[float, re.Match]:
    """When `pattern` first shows in the process's output (polled every 20 ms), and the match."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, " ".join(proc.output().split()))
        if match:
            return time.monotonic(), match
        if proc.returncode is not None:
            break
        time.sleep(0.02)
    raise RuntimeError(f"{proc.name}: no {pattern!r}:\n{proc.output()[-3000:]}")


class _Watch:
    """The time `pattern` first shows in a process's output, watched from a thread (while the
    bench does something else, e.g. waits for a restarted PS to listen)."""

    def __init__(self, proc, pattern: str, timeout: float):
        import threading

        self.at, self.match = None, None
        self._thread = threading.Thread(target=self._run, args=(proc, pattern, timeout), daemon=True)
        self._thread.start()

    def _run(self, proc, pattern, timeout):
        try:
            self.at, self.match = _first(proc, pattern, timeout)
        except RuntimeError:
            pass

    def result(self, timeout: float) -> tuple[float, re.Match]:
        self._thread.join(timeout)
        if self.at is None:
            raise RuntimeError(f"not seen: {self._thread.name}")
        return self.at, self.match


def rows_lost(got: dict, reference: dict) -> int:
    """Embedding rows of `reference` that `got` lacks or holds with other values (slots included)."""
    import torch

    lost = 0
    for key in [k for k in reference["ps"] if k.startswith("emb/") and k.endswith("/keys")]:
        prefix, ref_keys = key[:-len("keys")], reference["ps"][key]
        got_keys = got["ps"].get(key, ref_keys[:0])
        ref_order, got_order = torch.argsort(ref_keys), torch.argsort(got_keys)
        held = torch.isin(ref_keys[ref_order], got_keys)
        same = held.clone()
        if bool(held.all()) and got_keys.numel() == ref_keys.numel():
            for field, value in reference["ps"].items():
                if field.startswith(prefix) and value.dim() > 0:
                    diff = value[ref_order] != got["ps"][field][got_order]
                    same &= ~(diff.reshape(diff.shape[0], -1).any(1))
        lost += int((~same).sum())
    return lost


def _wait_all(procs, timeout=900) -> None:
    for proc in procs:
        if proc.wait(timeout) != 0:
            raise RuntimeError(f"{proc.name} failed:\n{proc.output()[-3000:]}")


def _partition(cluster, workdir: str, sync: bool) -> dict:
    data, workers = write_data(workdir), 2 if sync else 1
    steps, extra = (260, ["--sync"]) if sync else (400, [])
    results = {}
    for run in ("ref", "cut"):
        ps = start_ps(cluster.host(f"{run}-{int(sync)}-ps"), 0, 1, name=f"{run}-{int(sync)}-ps")
        hosts = [cluster.host(f"{run}-{int(sync)}-w{i}") for i in range(workers)]
        ckpt = os.path.join(workdir, f"partition-{int(sync)}-{run}")
        args = ["--data", data, "--steps", str(steps), "--checkpoint-dir", ckpt, *extra]
        procs = [start_worker(h, [ps.host], i, workers, args, name=f"{run}-{int(sync)}-worker{i}")
                 for i, h in enumerate(hosts)]
        if run == "cut":
            _first(procs[0], r"step 100 loss", 600)
            hosts[0].cut()
            cut = time.monotonic()
            detected, _ = _first(procs[0], r"unanswered \(\w+\), retrying", 60)
            time.sleep(max(0.0, CUT_S - (time.monotonic() - cut)))
            hosts[0].restore()
            back = time.monotonic()
            recovered, _ = _first(procs[0], r"answered again after", 120)
            results.update(detect_s=round(detected - cut, 2), recover_s=round(recovered - back, 2))
        _wait_all(procs)
        ps.kill()
        results[run] = final_state(ckpt)
    return {"fault": f"partition ({'sync, 2 workers' if sync else 'async, 1 worker'}), {CUT_S:.0f} s",
            "detect_s": results["detect_s"], "recover_s": results["recover_s"], "steps_redone": 0,
            "rows_lost": rows_lost(results["cut"], results["ref"])}


def _ps_restart(cluster, workdir: str) -> dict:
    data, ckpt = write_data(workdir), os.path.join(workdir, "restart")
    args = ["--data", data, "--steps", "300", "--checkpoint-every", "100"]
    ps = [start_ps(cluster.host(f"r-ps{i}"), i, 2, name=f"r-ps{i}") for i in range(2)]
    worker = start_worker(cluster.host("r-w0"), [p.host for p in ps], 0, 1, [*args, "--checkpoint-dir", ckpt])
    manifest = os.path.join(ckpt, "checkpoint-000000100.manifest.json")
    deadline = time.monotonic() + 600
    while not os.path.exists(manifest) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(2.0)
    watch = _Watch(worker, r"PS 1 at [\d.:]+: \w+ unanswered|PS 1 at [\d.:]+: restarted", 120)
    killed = time.monotonic()  # before: the worker may log it while kill() still reaps the PS
    ps[1].kill()
    again = start_ps(ps[1].host, 1, 2, name="r-ps1-again")
    listening = time.monotonic()
    detected, _ = watch.result(130)
    recovered, match = _first(worker, r"rolled back to the checkpoint of step (\d+) \((?:steps (\d+)-(\d+)|no step)", 120)
    _wait_all([worker])
    got = final_state(ckpt)
    again.kill()
    ps[0].kill()
    step = int(match.group(1))
    fresh = os.path.join(workdir, "restart-resumed")
    copy_checkpoint(ckpt, step, fresh)
    ref_ps = [start_ps(cluster.host(f"rr-ps{i}"), i, 2, name=f"rr-ps{i}") for i in range(2)]
    ref = start_worker(cluster.host("rr-w0"), [p.host for p in ref_ps], 0, 1,
                       [*args, "--checkpoint-dir", fresh, "--resume"], name="rr-worker0")
    _wait_all([ref])
    redone = int(match.group(3)) - int(match.group(2)) + 1 if match.group(2) else 0
    return {"fault": "ps_restart (PS 1 of 2 SIGKILLed and started again, async, 1 worker)",
            "detect_s": round(detected - killed, 2), "recover_s": round(recovered - listening, 2),
            "steps_redone": redone, "rows_lost": rows_lost(got, final_state(fresh))}


def measure(workdir: str) -> list[dict]:
    """Each PS fault once, in its own hosts; raises RuntimeError where namespaces cannot be made."""
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = []
    for fault in (lambda c: _partition(c, workdir, False), lambda c: _partition(c, workdir, True),
                  lambda c: _ps_restart(c, workdir)):
        cluster = Cluster(os.path.join(workdir, "logs"))
        try:
            out.append(fault(cluster))
        finally:
            cluster.close()
    return out


if __name__ == "__main__":
    folder = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="faults-ps-")
    for row in measure(folder):
        print(json.dumps(row))
