"""Fault 1 of issue 28: a worker's link to the PS goes down for ~10 s mid-run, then comes back.

Within --ps-deadline the worker retries and goes on, each update applied exactly once: the job's
final PS state equals an uninterrupted run's, exactly (async and sync). Past the deadline the
worker exits with an error naming the PS and the time it waited. Hosts: tests/cluster.py.
"""
import re
import time

import pytest

from ps_jobs import differences, final_state, start_ps, start_worker, write_data

pytestmark = pytest.mark.slow
CUT_S = 10
STEP = r"step (\d+) loss"


def _job(cluster, tmp_path, name: str, workers: int, steps: int, cut: int | None, extra=()) -> tuple[dict, list]:
    """A job of one PS host and `workers` worker hosts; `cut`: the worker whose link goes down for
    CUT_S seconds once it has done 100 steps. Returns (final checkpoint, worker Procs)."""
    data, ckpt = write_data(tmp_path), str(tmp_path / name)
    ps = start_ps(cluster.host(f"{name}-ps"), 0, 1, name=f"{name}-ps")
    hosts = [cluster.host(f"{name}-w{i}") for i in range(workers)]
    args = ["--data", data, "--steps", str(steps), "--checkpoint-dir", ckpt, "--ps-deadline", "60", *extra]
    procs = [start_worker(h, [ps.host], i, workers, args, name=f"{name}-worker{i}") for i, h in enumerate(hosts)]
    if cut is not None:
        procs[cut].wait_for(r"step 100 loss", 300)
        hosts[cut].cut()
        time.sleep(CUT_S)
        hosts[cut].restore()
    for proc in procs:
        assert proc.wait(600) == 0, proc.output()[-4000:]
    ps.kill()
    return final_state(ckpt), procs


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_a_partition_within_the_deadline_loses_and_repeats_no_update(cluster, tmp_path, sync):
    workers, extra = (2, ["--sync"]) if sync else (1, [])
    steps = 260 if sync else 400
    reference, _ = _job(cluster, tmp_path, "ref", workers, steps, None, extra)
    cut, procs = _job(cluster, tmp_path, "cut", workers, steps, 0, extra)
    assert cut["step"] == reference["step"] == steps
    assert differences(cut, reference) == []
    log = procs[0].output()
    assert re.search(r"PS 0 at [\d.]+:\d+: \w+ unanswered \(\w+\), retrying until", log), log[-3000:]
    assert re.search(r"PS 0 at [\d.]+:\d+: \w+ answered again after [\d.]+ s", log), log[-3000:]


def test_a_partition_past_the_deadline_fails_naming_the_ps(cluster, tmp_path):
    data = write_data(tmp_path)
    ps = start_ps(cluster.host("ps"), 0, 1)
    host = cluster.host("worker")
    worker = start_worker(host, [ps.host], 0, 1, ["--data", data, "--steps", "100000", "--ps-deadline", "4"])
    worker.wait_for(r"step 100 loss", 300)
    host.cut()
    started = time.monotonic()
    try:
        code = worker.wait(4 + 30)
    finally:
        host.restore()
    assert code != 0 and time.monotonic() - started < 4 + 30
    out = worker.output()
    assert re.search(rf"PS 0 at {re.escape(ps.host.address)}:\d+: \w+ not answered for \d+ s \(--ps-deadline 4\)",
                     out), out[-3000:]
