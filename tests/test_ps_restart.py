"""Fault 2 of issue 28: a PS is killed mid-run and started again on the same address.

The workers (the same processes) notice the restart, roll every PS back to the job's last
checkpoint and go on from its step: the job's final state equals an uninterrupted job resumed
(--resume) from that checkpoint, exactly. Without --checkpoint-dir the restart is a clear error.
Hosts: tests/cluster.py.
"""
import os
import re

import pytest

from ps_jobs import copy_checkpoint, differences, final_state, start_ps, start_worker, write_data
from waits import wait_until

pytestmark = pytest.mark.slow
STEPS, EVERY = 300, 100


def _run(cluster, name: str, workers: int, args: list[str]) -> tuple[list, list]:
    ps = [start_ps(cluster.host(f"{name}-ps{i}"), i, 2, name=f"{name}-ps{i}") for i in range(2)]
    procs = [start_worker(cluster.host(f"{name}-w{i}"), [p.host for p in ps], i, workers, args, name=f"{name}-worker{i}")
             for i in range(workers)]
    return ps, procs


@pytest.mark.parametrize("workers,extra", [(1, []), (2, ["--sync"])], ids=["async-1-worker", "sync-2-workers"])
def test_a_restarted_ps_rolls_the_job_back_to_its_last_checkpoint(cluster, tmp_path, workers, extra):
    data, ckpt = write_data(tmp_path), str(tmp_path / "ckpt")
    common = ["--data", data, "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--ps-deadline", "60",
              "--log-every", "10", *extra]
    ps, procs = _run(cluster, "job", workers, [*common, "--checkpoint-dir", ckpt])
    first = os.path.join(ckpt, f"checkpoint-{EVERY:09d}.manifest.json")
    wait_until(lambda: os.path.exists(first), 300, first)
    procs[0].wait_for(rf"step {EVERY + 20} loss", 300)  # some steps past the checkpoint
    ps[1].kill()
    again = start_ps(ps[1].host, 1, 2, name="job-ps1-again")
    for proc in procs:
        assert proc.wait(600) == 0, proc.output()[-4000:]
    line = re.search(r"PS 1 at ([\d.]+):\d+: restarted, its rows are gone .*?: rolled back to the checkpoint of step "
                     r"(\d+) \((steps \d+-\d+|no step) redone", procs[0].output())
    assert line and line.group(1) == ps[1].host.address, procs[0].output()[-4000:]
    step = int(line.group(2))
    assert step % EVERY == 0 and step < STEPS
    for proc in procs[1:]:
        assert f"rolled back to the checkpoint of step {step}" in proc.output()
    got = final_state(ckpt)
    again.kill()
    ps[0].kill()
    fresh = str(tmp_path / "resumed")
    copy_checkpoint(ckpt, step, fresh)
    _, resumed = _run(cluster, "ref", workers, [*common, "--checkpoint-dir", fresh, "--resume"])
    for proc in resumed:
        assert proc.wait(600) == 0, proc.output()[-4000:]
    assert f"at step {step}" in resumed[0].output()
    assert differences(got, final_state(fresh)) == []


def test_a_restarted_ps_without_a_checkpoint_dir_is_a_clear_error(cluster, tmp_path):
    data = write_data(tmp_path)
    ps = start_ps(cluster.host("ps"), 0, 1)
    worker = start_worker(cluster.host("worker"), [ps.host], 0, 1, ["--data", data, "--steps", "100000"])
    worker.wait_for(r"step 100 loss", 300)
    ps.kill()
    start_ps(ps.host, 0, 1, name="ps-again")
    assert worker.wait(120) != 0
    out = worker.output()
    assert re.search(rf"PS 0 at {re.escape(ps.host.address)}:\d+: restarted, its rows are gone .*there is no "
                     r"checkpoint to roll back to: train with --checkpoint-dir", out), out[-3000:]
