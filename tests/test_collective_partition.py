"""Fault 4 of issue 28, a partition during collective training: two ranks on two hosts (network
namespaces, tests/cluster.py), the embedding all-to-all every step. Rank 1's link is cut (packets
dropped: no reset, gloo's recv just waits) for longer than --collective-timeout: both ranks stop
within the timeout + 30 s with one line naming the rank that stopped answering, exit 1, none hangs.
With the link back, `--resume` on both hosts finishes the job with the model of an uninterrupted
run, bit for bit."""
from __future__ import annotations

import re
import sys
import time

import pytest

from test_elastic import EVERY, STEPS, TRAIN, _env, assert_same_states, final_states, uninterrupted  # noqa: F401

pytestmark = pytest.mark.slow

TIMEOUT_S = 10
SLACK_S = 30  # what deadline.py states: a rank cut off makes the others exit within the timeout plus 30 s


def start_ranks(hosts, env: dict, ckpt, port: int, *extra: str) -> list:
    """Rank r of 2 on hosts[r], as torchrun would start it with --nnodes 2 (rank 0's host is the master)."""
    rendezvous = dict(env, MASTER_ADDR=hosts[0].address, MASTER_PORT=str(port), WORLD_SIZE="2", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1", GLOO_SOCKET_IFNAME="eth0")  # gloo: the host's own link
    argv = [sys.executable, "-m", "deeprec", *TRAIN[:-1], str(STEPS), "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", str(EVERY), "--collective-timeout", str(TIMEOUT_S), *extra]
    return [host.run(argv, name=f"rank{r}-{port}", env=dict(rendezvous, RANK=str(r))) for r, host in enumerate(hosts)]


def wait_for_file(path, procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for proc in procs:
            assert proc.returncode is None, f"{proc.name} exited ({proc.returncode}):\n{proc.output()[-3000:]}"
        assert time.monotonic() < deadline, f"no {path} within {timeout:.0f} s"
        time.sleep(0.05)


def wait_exits(procs, since: float, bound: float) -> dict[str, tuple[int, float]]:
    """Each process's (exit code, seconds from `since`), waited for at most `bound` s from `since`."""
    ended: dict[str, tuple[int, float]] = {}
    while len(ended) < len(procs):
        for proc in procs:
            if proc.name not in ended and proc.returncode is not None:
                ended[proc.name] = (proc.returncode, time.monotonic() - since)
        if time.monotonic() - since > bound:
            hung = [p.name for p in procs if p.name not in ended]
            raise AssertionError(f"{hung} still running {bound:.0f} s after the cut:\n" +
                                 "\n".join(p.output()[-2000:] for p in procs))
        time.sleep(0.05)
    return ended


def test_a_cut_link_stops_every_rank_within_the_timeout_and_resume_ends_with_the_uninterrupted_model(
        cluster, tmp_path, uninterrupted):  # noqa: F811
    expected, env = uninterrupted
    hosts = [cluster.host("node0"), cluster.host("node1")]
    ckpt = tmp_path / "ckpt"
    ranks = start_ranks(hosts, env, ckpt, 29500)
    wait_for_file(ckpt / "rank-1-of-2" / f"checkpoint-{EVERY:09d}.manifest.json", ranks, 120)
    hosts[1].cut()  # mid-training: one step saved, the all-to-all runs every step
    cut = time.monotonic()
    ended = wait_exits(ranks, cut, TIMEOUT_S + SLACK_S)
    for r, proc in enumerate(ranks):
        code, took = ended[proc.name]
        out = proc.output()
        assert code == 1, out[-3000:]
        assert TIMEOUT_S - 2 <= took < TIMEOUT_S + SLACK_S, (proc.name, took)
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, out[-3000:]  # one line, no traceback
        assert errors[0].startswith(f"error: collective training: rank {1 - r} stopped answering (stopped, killed "
                                    f"or cut off); rank {r} gave up on "), errors[0]  # one whole line
        assert f"(--collective-timeout {TIMEOUT_S} s)" in errors[0]
        assert "Traceback" not in out and "frame #" not in out, out[-3000:]  # no C++ stack trace either
    hosts[1].restore()

    resumed = start_ranks(hosts, env, ckpt, 29501, "--resume")
    for proc in resumed:
        assert proc.wait(150) == 0, proc.output()[-3000:]
    steps = [re.search(r"resumed from checkpoint-\d+\.pt at step (\d+)", proc.output()) for proc in resumed]
    assert all(steps) and steps[0].group(1) == steps[1].group(1), [p.output()[-2000:] for p in resumed]
    assert int(steps[0].group(1)) >= EVERY
    assert_same_states(final_states(ckpt), expected)
