"""No hang (issue #32, part 5): every collective of collective training has a deadline,
`--collective-timeout`; a rank stopped (SIGSTOP), killed or cut off makes the others exit within
it + 30 s, with one line naming that rank, exit code 1 and no traceback."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

pytestmark = pytest.mark.slow

TIMEOUT_S = 10
SLACK_S = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children_with(parent: int, **env: str) -> list[int]:
    """The processes whose parent is `parent` and whose environment holds `env`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                variables = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except (OSError, ValueError, IndexError):
            continue
        if all(variables.get(k.encode()) == v.encode() for k, v in env.items()):
            found.append(int(name))
    return found


def _release(pid: int | None) -> None:
    """A process this test stopped: continued and killed (it may be gone already)."""
    if pid is None:
        return
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


class _Output:
    """A process's output, read by a thread as it comes."""

    def __init__(self, pipe):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe) -> None:
        for line in iter(pipe.readline, ""):
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)


def _flat(text: str) -> str:
    """A worker's console wraps long lines: compare without the prefixes and whitespace."""
    return "".join(text.replace("[worker0]", "").replace("[worker1]", "").split())


@pytest.mark.parametrize("victim", [1, 0])
def test_a_stopped_rank_ends_the_collective_job_within_the_timeout(tmp_path, victim):
    """SIGSTOP on one rank mid-training: the other gives up on its collective after
    --collective-timeout, names the stopped rank in one line and exits 1; the launcher then stops the
    stopped rank and exits 1. Rank 1 is named by its heartbeat standing still, rank 0 by the
    rendezvous store it holds not answering."""
    other = 1 - victim
    env = dict(os.environ, DEEPREC_CACHE=str(tmp_path), OMP_NUM_THREADS="1")
    ckpt = tmp_path / "ckpt"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "deeprec.cli", "launch", "--workers", "2", "--collective", "--",
         "train", "--synthetic", "4000", "--steps", "1000000", "--batch-size", "64", "--no-progress",
         "--checkpoint-dir", str(ckpt), "--checkpoint-every", "20", "--collective-timeout", str(TIMEOUT_S)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output = _Output(launcher.stdout)
    stopped = None
    try:
        deadline = time.monotonic() + 240
        while not list(ckpt.glob("rank-1-of-2/checkpoint-*.manifest.json")):  # mid-training: a step saved
            assert launcher.poll() is None, output.text[-3000:]
            assert time.monotonic() < deadline, "rank 1 saved no checkpoint in 240 s:\n" + output.text[-3000:]
            time.sleep(0.2)
        ranks = _children_with(launcher.pid, RANK=str(victim), DEEPREC_LAUNCHED="1")
        assert len(ranks) == 1, ranks
        stopped = ranks[0]
        os.kill(stopped, signal.SIGSTOP)
        since = time.monotonic()
        code = launcher.wait(TIMEOUT_S + SLACK_S + 15)  # the launcher's own reaping: a few s more
        took = time.monotonic() - since
        output.thread.join(10)
    finally:
        _release(stopped)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
    out = output.text
    assert code == 1, out[-3000:]
    assert took < TIMEOUT_S + SLACK_S, f"the job ended {took:.1f} s after the SIGSTOP"
    assert f"worker{other} failed with exit code 1" in out, out[-3000:]
    assert "Traceback" not in out and "internal error" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith(f"[worker{other}] error:")]
    assert len(errors) == 1, out[-3000:]  # one line
    said = _flat("\n".join(line for line in out.splitlines() if line.startswith(f"[worker{other}]")))
    assert f"error:collectivetraining:rank{victim}stoppedanswering" in said, out[-3000:]
    assert f"--collective-timeout{TIMEOUT_S}s" in _flat(out)


_RANK = textwrap.dedent("""
    import os, signal, sys, time, torch, torch.distributed as dist
    from deeprec.distributed.collective import deadline
    from deeprec.distributed.allreduce import Rendezvous, join_process_group
    from deeprec.errors import DeepRecError

    rank, port, fault = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    limit = deadline.install(3, rank, 2, "127.0.0.1", port)
    with deadline.guard("the rendezvous"):
        join_process_group(Rendezvous("127.0.0.1", port, rank, 2), torch.device("cpu"), timeout_s=3)
    limit.start_heartbeat()
    group = dist.new_group(backend="gloo", timeout=deadline.timeout())  # as the embedding exchange's
    store, beats = limit._client(), [f"deeprec/heartbeat/{r}" for r in range(2)]
    while not (store.check(beats) and all(int(store.get(k)) >= 1 for k in beats)):  # both ranks have beaten
        time.sleep(0.05)
    try:
        for step in range(100000):
            if rank == 1 and step == 20:
                os.kill(os.getpid(), signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
            out = torch.empty(2)
            with deadline.guard("the all-to-all of the embedding exchange"):
                dist.all_to_all_single(out, torch.ones(2), group=group)
    except DeepRecError as err:
        print(f"{type(err).__name__}: {err}", flush=True)
        os._exit(1)
""")


@pytest.mark.parametrize("fault", ["stop", "kill"])
def test_a_collective_on_its_own_group_names_the_rank_that_stopped_answering(fault):
    """Two bare gloo ranks, an all-to-all on a group of its own (which once took torch's 30-minute
    default): rank 1 stopped or killed; rank 0 raises CollectiveTimeout naming rank 1."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), str(port), fault],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        started = time.monotonic()
        out, _ = procs[0].communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        for proc in procs:
            _release(proc.pid)
            proc.wait(10)
    assert procs[0].returncode == 1, out
    assert "CollectiveTimeout: collective training: rank 1 stopped answering" in out, out
    assert "the all-to-all of the embedding exchange" in out and "Traceback" not in out
    assert took < 3 + SLACK_S + 15, took  # the start of two interpreters included


_HUNG = textwrap.dedent("""
    import time
    from deeprec.distributed.collective import deadline
    deadline.GRACE_S = 1.0
    deadline.install(1, 0, 2, "127.0.0.1", 1)  # no heartbeat: the line names the collective
    with deadline.guard("the dense all-reduce"):
        time.sleep(60)  # a collective that ignores its timeout (NCCL without async error handling)
""")


def test_the_watchdog_ends_a_collective_that_ignores_its_timeout():
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _HUNG], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: collective training: the dense all-reduce did not complete on rank 0 within "
        "--collective-timeout 1 s. Every rank must run: restart the job with --resume"]
    assert took < 20, took


def test_collective_timeout_is_an_option_with_a_bound():
    from deeprec.errors import ConfigError
    from deeprec.train_config import DistributedConfig, TrainConfig

    assert DistributedConfig().collective_timeout < 300
    assert TrainConfig.create(data=["x.tsv"], distributed={"collective_timeout": 10}).distributed.collective_timeout == 10
    with pytest.raises(ConfigError, match="collective.timeout"):
        TrainConfig.create(data=["x.tsv"], distributed={"collective_timeout": 0})


_ALONE = textwrap.dedent("""
    import sys, torch
    from deeprec.distributed.collective import deadline
    from deeprec.distributed.allreduce import Rendezvous, join_process_group
    from deeprec.errors import DeepRecError

    port = int(sys.argv[1])
    deadline.install(2, 0, 2, "127.0.0.1", port)
    try:
        with deadline.guard("the rendezvous (creating the process group)"):
            join_process_group(Rendezvous("127.0.0.1", port, 0, 2), torch.device("cpu"), timeout_s=2)
    except DeepRecError as err:
        print(f"{type(err).__name__}: {err}", flush=True)
        raise SystemExit(1)
""")


def test_a_rendezvous_that_a_rank_never_joins_ends_within_the_timeout():
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _ALONE, str(_free_port())], capture_output=True, text=True,
                          timeout=60)
    took = time.monotonic() - started
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.startswith("CollectiveTimeout: collective training: the rendezvous (creating the process "
                                  "group) did not complete on rank 0 within --collective-timeout 2 s"), done.stdout
    assert "1/2 clients joined" in done.stdout and "Traceback" not in done.stderr
    assert took < 2 + SLACK_S, took
