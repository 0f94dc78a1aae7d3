"""Fault 3 of issue 28, elastic collective training: a rank killed (SIGKILL) under
`torchrun --max-restarts` or `deeprec launch --collective --max-restarts` makes the agent restart
every rank; each resumes from the last checkpoint by itself (TORCHELASTIC_RESTART_COUNT > 0, no
--resume given) and the job ends with the model of an uninterrupted run, bit for bit. Past the
last restart the job fails and says the restarts are exhausted."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from test_collective_timeout import _children_with, _Output

pytestmark = pytest.mark.slow

STEPS, EVERY = 200, 50
TRAIN = ["train", "--synthetic", "4000", "--cardinalities", "small", "--batch-size", "32", "--no-progress",
         "--threads", "1", "--steps", str(STEPS)]


def _env(tmp_path) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", DEEPREC_CACHE=str(tmp_path / "cache"))


def final_states(ckpt, step: int = STEPS) -> list[dict]:
    from deeprec.checkpoint import load_checkpoint

    return [load_checkpoint(str(ckpt / f"rank-{r}-of-2" / f"checkpoint-{step:09d}.pt")) for r in range(2)]


def assert_same_states(got: list[dict], expected: list[dict]) -> None:
    """Every tensor and value of every rank's checkpoint equal (the reader position and RNG included)."""
    def flat(x, path=""):
        if isinstance(x, dict):
            for k, v in x.items():
                yield from flat(v, f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                yield from flat(v, f"{path}/{i}")
        else:
            yield path, x

    for rank, (a, b) in enumerate(zip(got, expected)):
        a, b = dict(flat(a)), dict(flat(b))
        assert a.keys() == b.keys(), (rank, a.keys() ^ b.keys())
        differ = [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]
        assert not differ, f"rank {rank}: {differ[:10]}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The job run through without a fault: its final checkpoints, and the environment (data cache) to share."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    done = subprocess.run([sys.executable, "-m", "deeprec.cli", "launch", "--workers", "2", "--collective", "--",
                           *TRAIN, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", str(EVERY)],
                          capture_output=True, text=True, timeout=240, env=_env(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return final_states(tmp_path / "ckpt"), _env(tmp_path)


def kill_rank(parent: subprocess.Popen, output: _Output, ready, rank: int = 1, restart: int = 0,
              timeout: float = 120) -> int:
    """SIGKILL to `rank` (a child of `parent` started for restart `restart`) once `ready()` holds."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert parent.poll() is None, output.text[-3000:]
        assert time.monotonic() < deadline, "not ready in time:\n" + output.text[-3000:]
        time.sleep(0.05)
    ranks = _children_with(parent.pid, RANK=str(rank), TORCHELASTIC_RESTART_COUNT=str(restart))
    assert len(ranks) == 1, (ranks, output.text[-3000:])
    os.kill(ranks[0], signal.SIGKILL)
    return ranks[0]


def saved(ckpt, step: int):
    """Every rank's checkpoint of `step` written: only then is there a step to resume from (the newest
    every rank saved). Rank 1's alone is not enough: killed then, rank 1 takes rank 0 with it
    (deeprec launch kills the other ranks at once) while rank 0 may still be writing its own."""
    return lambda: all((ckpt / f"rank-{r}-of-2" / f"checkpoint-{step:09d}.manifest.json").exists() for r in range(2))


def run_and_kill(argv: list[str], env: dict, ckpt, timeout: float = 200) -> tuple[int, str]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output = _Output(proc.stdout)
    try:
        kill_rank(proc, output, saved(ckpt, EVERY))
        code = proc.wait(timeout)
        output.thread.join(10)
    finally:
        if proc.poll() is None:  # its ranks first: torchrun starts them in sessions of their own
            for pid in _children_with(proc.pid):
                with contextlib.suppress(ProcessLookupError):  # it may have ended since
                    os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait(10)
    return code, output.text


def resumed_step(out: str) -> int:
    """The step both ranks say they resumed from on restart 1 (the same for both), each in a line of its own
    (prefixed [workerN] by deeprec launch, [rank N] by the rank itself under torchrun)."""
    said = re.findall(r"^\[(worker|rank )(\d)\] resumed from checkpoint-\d+\.pt at step (\d+) "
                      r"\(restart 1, TORCHELASTIC_RESTART_COUNT\)$", out, re.MULTILINE)
    assert sorted(rank for _, rank, _ in said) == ["0", "1"] and said[0][2] == said[1][2], out[-4000:]
    return int(said[0][2])


def test_torchrun_restarts_the_group_and_every_rank_resumes_from_the_checkpoint(tmp_path, uninterrupted):
    expected, env = uninterrupted
    ckpt = tmp_path / "ckpt"
    code, out = run_and_kill(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
         "-m", "deeprec", *TRAIN, "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY)], env, ckpt)
    assert code == 0, out[-4000:]
    assert "failed (exitcode: -9) local_rank: 1" in out, out[-4000:]  # torchrun's agent saw the kill
    assert resumed_step(out) >= EVERY  # no --resume given: TORCHELASTIC_RESTART_COUNT made them resume
    assert "Traceback" not in out, out[-4000:]
    assert_same_states(final_states(ckpt), expected)


def test_launch_max_restarts_says_what_happened_and_ends_with_the_uninterrupted_model(tmp_path, uninterrupted):
    expected, env = uninterrupted
    ckpt = tmp_path / "ckpt"
    code, out = run_and_kill([sys.executable, "-m", "deeprec.cli", "launch", "--workers", "2", "--collective",
                              "--max-restarts", "2", "--", *TRAIN, "--checkpoint-dir", str(ckpt),
                              "--checkpoint-every", str(EVERY)], env, ckpt)
    assert code == 0, out[-4000:]
    said = re.findall(r"\[launch\] restart 1 of 2: rank 1 exited with -9 \(SIGKILL\); resuming every rank from the "
                      r"checkpoint of step (\d+)\n", out)
    assert len(said) == 1 and "restart 2 of 2" not in out, out[-4000:]
    assert resumed_step(out) == int(said[0]) >= EVERY
    assert "[launch] 2/2 workers succeeded" in out and "Traceback" not in out
    assert_same_states(final_states(ckpt), expected)


def test_past_max_restarts_the_job_fails_and_says_restarts_are_exhausted(tmp_path, uninterrupted):
    """Killed before any checkpoint: the restarted ranks start from step 0 (and say why); the second
    kill is past --max-restarts 1."""
    _, env = uninterrupted
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "deeprec.cli", "launch", "--workers", "2", "--collective",
                             "--max-restarts", "1", "--", *TRAIN[:-1], "1000000", "--checkpoint-dir", str(ckpt)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output = _Output(proc.stdout)
    try:
        kill_rank(proc, output, lambda: "[worker1] step 100 loss" in output.text)
        kill_rank(proc, output, lambda: output.text.count("[worker1] step 100 loss") == 2, restart=1)
        code = proc.wait(60)
        output.thread.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    out = output.text
    assert code != 0, out[-4000:]
    assert f"[launch] restart 1 of 1: rank 1 exited with -9 (SIGKILL); no checkpoint in {ckpt}: every rank starts " \
           "over from step 0" in out, out[-4000:]
    for rank in (0, 1):  # each rank's own line, whole
        said = f"[worker{rank}] no checkpoint in {ckpt}: starting from step 0 (restart 1, TORCHELASTIC_RESTART_COUNT)"
        assert out.splitlines().count(said) == 1, out[-4000:]
    assert "[launch] restarts exhausted (--max-restarts 1): rank 1 exited with -9 (SIGKILL) on restart 1; the job " \
           "failed" in out, out[-3000:]
    assert "[launch] 0/2 workers succeeded" in out


def test_without_a_checkpoint_dir_the_launcher_and_the_ranks_warn_that_a_restart_starts_over(tmp_path, monkeypatch,
                                                                                            capsys):
    done = subprocess.run([sys.executable, "-m", "deeprec.cli", "launch", "--workers", "1", "--collective",
                           "--max-restarts", "1", "--", "train", "--data", str(tmp_path / "missing.tsv")],
                          capture_output=True, text=True, timeout=120, env=_env(tmp_path))
    out = done.stdout
    assert done.returncode == 2, out + done.stderr
    assert ("[launch] warning: --max-restarts 1 without the worker command's --checkpoint-dir: a restart starts over "
            "from step 0") in out
    assert "[launch] restart 1 of 1: rank 0 exited with 2; no --checkpoint-dir: every rank starts over from " \
           "step 0" in out
    assert "[launch] restarts exhausted (--max-restarts 1): rank 0 exited with 2 on restart 1; the job failed" in out
    assert out.count("missing.tsv") >= 2  # the rank's own error, each start

    from deeprec.distributed.collective.elastic import resume_reason
    from deeprec.train_config import TrainConfig

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    assert resume_reason(TrainConfig.create(data=["x.tsv"]), rank=1) is None
    assert capsys.readouterr().err == (
        "warning: rank 1: restarts are on (TORCHELASTIC_MAX_RESTARTS=2, this is restart 1) but there is no "
        "--checkpoint-dir: a restart starts over from step 0; give --checkpoint-dir (and --checkpoint-every) to "
        "resume from the last checkpoint\n")
    with_dir = TrainConfig.create(data=["x.tsv"], checkpoint={"dir": str(tmp_path)})
    assert resume_reason(with_dir, rank=1) == "restart 1, TORCHELASTIC_RESTART_COUNT"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert resume_reason(with_dir, rank=1) is None  # a first start resumes only with --resume


def test_max_restarts_needs_a_collective_job():
    done = subprocess.run([sys.executable, "-m", "deeprec.cli", "launch", "--workers", "2", "--max-restarts", "1",
                           "--", "train"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--max-restarts restarts the ranks of a collective job: add --collective" in done.stderr
