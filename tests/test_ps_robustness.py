"""A PS probed as a careless or hostile client on loopback would: every malformed field gets
INVALID_ARGUMENT, limits get RESOURCE_EXHAUSTED, nothing half-changes, and the PS stays up."""
import json
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from deeprec.distributed import PSClient
from deeprec.distributed.ps.shard import SERVICE
from deeprec.distributed.ps.wire import pack, unpack

from conftest import running_ps  # noqa: E402
from waits import wait_until


def start(*extra):
    proc = subprocess.Popen([sys.executable, "-m", "deeprec.distributed.ps", "--bind", "127.0.0.1:0", "--threads", "4",
                             *extra], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "listening on" in line, line
    return proc, line.split()[-1]


@pytest.fixture
def ps():
    started = []

    def make(*extra):
        proc, address = start(*extra)
        started.append(proc)
        channel = grpc.insecure_channel(address)
        calls = {m: channel.unary_unary(f"/{SERVICE}/{m}") for m in ("Register", "Pull", "Push", "Load", "Export",
                                                                      "Health")}
        return proc, address, calls

    yield make
    for proc in started:
        proc.kill()
        proc.wait(10)


def waiting_pulls(calls) -> int:
    """Sync pulls the PS holds waiting for a step now (its Health)."""
    return unpack(calls["Health"](pack({}), timeout=3))[0]["waiting_pulls"]


def status(call, request, timeout=10):
    try:
        return call(request, timeout=timeout), None
    except grpc.RpcError as err:
        return None, err


def test_malformed_fields_get_invalid_argument(ps):
    proc, _, calls = ps()
    register = calls["Register"]
    deep = b"[" * 100_000 + b"]" * 100_000
    cases = [
        (register, pack({"variables": [{"name": "e", "kind": "embedding"}]}), "'dim' must be int"),
        (register, pack({"variables": [{"name": "e", "kind": "embedding", "dim": "abc"}]}), "'dim' must be int"),
        (register, pack({"variables": [{"name": "e", "kind": "embedding", "dim": 100_000}]}), "'dim' must be in"),
        (register, pack({"variables": [{"name": "e", "kind": "embedding", "dim": 4, "lr": "x"}]}), "'lr' must be"),
        (register, pack({"variables": "abc"}), "'variables' must be a list"),
        (register, len(deep).to_bytes(4, "little") + deep, "nested too deeply"),
        (calls["Pull"], pack({"embeddings": []}, {})[:4] + json.dumps({"tensors": {"k": {
            "dtype": "int64", "shape": [1 << 62, 1 << 62], "off": 0, "n": 8}}}).encode()[4:], ""),
        (calls["Push"], pack({"embeddings": [], "workers": "many"}), "'workers' must be an int"),
        (calls["Pull"], pack({"embeddings": [], "after_step": "soon"}), "'after_step' must be an int"),
    ]
    for call, request, message in cases:
        _, err = status(call, request)
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, (message, err)
        assert message in err.details()
    assert proc.poll() is None
    assert unpack(calls["Health"](pack({}), timeout=5))[0]["generation"] == 0


def test_memory_budget_refuses_register_and_inserts(ps):
    _, address, calls = ps("--max-memory", str(8 << 20))
    dense = {"variables": [{"name": "w", "kind": "dense"}]}
    _, err = status(calls["Register"], pack(dense, {"init/w": torch.zeros(1 << 20)}))  # 4 MB x 3 with slots
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-memory" in err.details()
    client = PSClient([address], deadline_s=20)
    client.register({"emb": 64}, {})
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        for start_key in range(0, 1 << 20, 1 << 15):  # keep inserting until the budget is spent
            client.pull({"emb": torch.arange(start_key, start_key + (1 << 15))})
    assert client.pull({"emb": torch.tensor([1, 2])}, train=False)["emb"].shape == (2, 64)  # still serving
    client.close()


def test_duplicate_keys_share_one_row_and_their_gradients_are_summed(ps):
    _, address, _ = ps()
    client = PSClient([address], deadline_s=20)
    client.register({"emb": 2}, {}, optimizer="sgd", lr=1.0)
    rows = client.pull({"emb": torch.tensor([7, 7, 9])})["emb"]
    assert torch.equal(rows[0], rows[1])
    state = client.snapshot()
    assert sorted(state["emb/emb/keys"].tolist()) == [7, 9]  # one row for key 7
    client.push({"emb": (torch.tensor([7, 7]), torch.ones(2, 2))})  # pushed twice: summed, one update
    after = client.pull({"emb": torch.tensor([7])}, train=False)["emb"][0]
    assert torch.allclose(after, rows[0] - 2.0)
    client.close()


def test_a_bad_load_changes_nothing(ps):
    _, address, calls = ps()
    client = PSClient([address], deadline_s=20)
    client.register({"emb": 2}, {"w": torch.ones(3)})
    client.pull({"emb": torch.tensor([1, 2, 3])})
    before = client.snapshot()
    broken = {k: v for k, v in before.items() if not k.endswith("/freq")}  # a field missing
    _, err = status(calls["Load"], pack({}, broken))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "lacks" in err.details()
    after = client.snapshot()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    client.close()


@pytest.mark.slow
def test_waiting_pulls_are_bounded_and_health_is_always_answered(ps):
    _, address, calls = ps()
    waiting = pack({"embeddings": [], "after_step": 10 ** 12})
    results = []

    def wait():
        results.append(status(calls["Pull"], waiting, timeout=8)[1])

    threads = [threading.Thread(target=wait) for _ in range(3)]  # 4 gRPC threads: at most 2 may wait
    for t in threads:
        t.start()
    wait_until(lambda: waiting_pulls(calls) == 2 and len(results) == 1, 8, "2 pulls waiting, 1 refused")
    started = time.monotonic()
    assert unpack(calls["Health"](pack({}), timeout=3))[0]["shard"] == 0
    assert time.monotonic() - started < 2
    for t in threads:
        t.join(15)
    codes = sorted(err.code().name for err in results)
    assert codes == ["DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"], codes


def test_a_pull_whose_step_is_applied_takes_no_waiting_place(ps):
    """Sync, two workers, a PS with 2 gRPC threads (the tests' ps_pool): one waiting place. The fast
    worker's pull waits for step 2, which needs the slow worker's push of 2; the slow worker's pull of
    step 2 (after step 1, applied) must be answered at once, not refused for want of a waiting place
    until the fast one's attempt ends (each refusal retried, the step never done: a 60 s stall)."""
    _, _, calls = ps("--threads", "2")
    for step in (1, 1):
        assert status(calls["Push"], pack({"embeddings": [], "dense": [], "step": step, "workers": 2}))[1] is None
    results = []
    fast = threading.Thread(target=lambda: results.append(status(
        calls["Pull"], pack({"embeddings": [], "after_step": 2}), timeout=10)[1]))
    fast.start()
    wait_until(lambda: waiting_pulls(calls) == 1, 8, "the fast worker's pull waiting")  # holding the waiting place
    started = time.monotonic()
    _, err = status(calls["Pull"], pack({"embeddings": [], "after_step": 1}), timeout=5)
    assert err is None, err.details()
    assert time.monotonic() - started < 2
    assert fast.is_alive()  # still waiting for step 2
    for _ in range(2):
        assert status(calls["Push"], pack({"embeddings": [], "dense": [], "step": 2, "workers": 2}))[1] is None
    fast.join(5)
    assert not fast.is_alive() and results == [None]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_token_is_required_on_every_call(monkeypatch):
    import os

    from deeprec.distributed.ps.client import PSError

    env = dict(os.environ, DEEPREC_PS_TOKEN="s3cret-token")
    with running_ps("--bind", "127.0.0.1:0", env=env) as (_, line):
        address = line.split()[-1]
        for token in (None, "wrong-token"):
            if token is None:
                monkeypatch.delenv("DEEPREC_PS_TOKEN", raising=False)
            else:
                monkeypatch.setenv("DEEPREC_PS_TOKEN", token)
            client = PSClient([address], deadline_s=10)
            with pytest.raises(PSError, match="UNAUTHENTICATED"):
                client.register({"emb": 2}, {})
            client.close()
        monkeypatch.setenv("DEEPREC_PS_TOKEN", "s3cret-token")
        client = PSClient([address], deadline_s=10)
        client.register({"emb": 2}, {})
        assert client.pull({"emb": torch.tensor([3])})["emb"].shape == (1, 2)
        client.close()


@pytest.mark.slow
def test_a_ps_on_a_public_address_needs_a_token_or_insecure(monkeypatch):
    import os

    env = {k: v for k, v in os.environ.items() if k != "DEEPREC_PS_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "deeprec.distributed.ps", "--bind", "0.0.0.0:0"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "no token" in done.stderr and "--insecure" in done.stderr
    with running_ps("--bind", "0.0.0.0:0", "--insecure", env=env) as (_, line):
        assert "listening on 0.0.0.0:" in line


@pytest.mark.slow
def test_tls_serves_clients_that_trust_its_ca(tmp_path, monkeypatch):
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    with running_ps("--bind", "127.0.0.1:0", "--tls-cert", str(cert), "--tls-key", str(key)) as (_, line):
        address = line.split()[-1]
        monkeypatch.setenv("DEEPREC_PS_TLS_CA", str(cert))
        client = PSClient([address], deadline_s=10)
        client.register({"emb": 2}, {})
        assert client.pull({"emb": torch.tensor([3])})["emb"].shape == (1, 2)
        client.close()
        monkeypatch.delenv("DEEPREC_PS_TLS_CA")
        plain = PSClient([address], deadline_s=5)
        with pytest.raises(Exception):
            plain.wait_ready(timeout_s=3)
            plain.register({"emb": 2}, {})
        plain.close()


def test_a_ps_takes_its_port_from_tf_config(tmp_path):
    import os

    port = free_port()
    tf_config = json.dumps({"cluster": {"ps": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:1"]},
                            "task": {"type": "ps", "index": 0}})
    with running_ps(env=dict(os.environ, TF_CONFIG=tf_config), cwd=tmp_path) as (_, line):
        assert f"listening on 127.0.0.1:{port}" in line


@pytest.mark.slow
def test_sigterm_to_launch_stops_and_reaps_every_process(tmp_path):
    import os
    import signal

    env = dict(os.environ, DEEPREC_CACHE=str(tmp_path))
    launcher = subprocess.Popen([sys.executable, "-m", "deeprec.cli", "launch", "--ps", "2", "--workers", "1", "--",
                                 "train", "--model", "dlrm", "--synthetic", "3000", "--cardinalities", "small",
                                 "--steps", "1000000", "--batch-size", "32"],
                                stdout=subprocess.PIPE, text=True, env=env)
    seen = []
    while len(seen) < 2:  # both PSs up, then the worker starts
        line = launcher.stdout.readline()
        assert line, "launch ended early"
        if "listening on" in line:
            seen.append(line)

    def children(pid):
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    kids = wait_until(lambda: k if len(k := children(launcher.pid)) == 3 else None, 30,
                      "two PSs and one worker started")
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(30) != 0
    for pid in kids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", pid


def test_a_stop_signal_while_a_worker_starts_stops_that_worker_too(monkeypatch):
    """The launcher's SIGTERM handler can run inside a worker's start, between its fork and its record
    (the test above met it under load: the worker outlived the launcher). The stop then waits for the
    record, and so reaches the new worker."""
    import signal

    from deeprec.distributed import launch as launch_module

    children, seen = launch_module.Children(), []
    handle = children.handler(lambda signum, frame: seen.append((signum, list(children.workers))))
    real_popen = subprocess.Popen

    def popen_signalled_midway(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        handle(signal.SIGTERM, None)  # as if SIGTERM landed here: forked, not yet recorded
        assert seen == []
        return proc

    monkeypatch.setattr(launch_module.subprocess, "Popen", popen_signalled_midway)
    proc = children.start([sys.executable, "-c", "import time; time.sleep(60)"], worker=True)
    try:
        assert seen == [(signal.SIGTERM, [proc])] and children.workers == [proc] and children == [proc]
        handle(signal.SIGINT, None)  # once started, a signal is acted on at once
        assert seen[-1] == (signal.SIGINT, [proc])
        monkeypatch.undo()
        children.stopping = signal.SIGTERM  # the job is stopping: a worker started now gets the stop too
        later = children.start([sys.executable, "-c", "import time; time.sleep(60)"], worker=True)
        assert later.wait(30) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait(10)


def test_a_repeated_push_is_applied_once_and_a_stale_caller_is_refused(ps):
    """Exactly-once retries: a Push (or training Pull) sent again with its (client, seq) gets its first
    reply without running again, sync pushes included; a caller that registered with another
    incarnation or restore of the PS gets FAILED_PRECONDITION, and a Load ends a waiting sync pull."""
    _, address, calls = ps()
    client = PSClient([address], deadline_s=20)
    client.register({"emb": 2}, {}, optimizer="sgd", lr=1.0)
    start = client.pull({"emb": torch.tensor([7])})["emb"][0]
    push = pack({"embeddings": ["emb"], "dense": [], "client": "w0", "seq": 1},
                {"keys": torch.tensor([7]), "counts": torch.tensor([1]), "grads/2": torch.ones(1, 2)})
    for _ in range(3):
        assert status(calls["Push"], push)[1] is None
    after = client.pull({"emb": torch.tensor([7])}, train=False)["emb"][0]
    assert torch.allclose(after, start - 1.0)  # one update, not three
    sync = pack({"embeddings": [], "dense": [], "step": 1, "workers": 2, "client": "w0", "seq": 2})
    for _ in range(2):  # the same worker's push of step 1, twice: the step still waits for the other worker
        assert status(calls["Push"], sync)[1] is None
    assert unpack(calls["Health"](pack({}), timeout=3))[0]["applied_step"] == 0
    identity = unpack(calls["Health"](pack({}), timeout=3))[0]
    stale = pack({"embeddings": [], "dense": [], "expect": ["another", identity["generation"]]})
    _, err = status(calls["Pull"], stale)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "restarted" in err.details()
    waiting = pack({"embeddings": [], "after_step": 5, "expect": [identity["incarnation"], identity["generation"]]})
    results = []
    thread = threading.Thread(target=lambda: results.append(status(calls["Pull"], waiting, timeout=20)[1]))
    thread.start()
    wait_until(lambda: waiting_pulls(calls) == 1, 10, "the pull waiting for step 5")
    client.restore(client.snapshot(), step=0)
    thread.join(10)
    assert not thread.is_alive() and results[0].code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "rolled back" in results[0].details()
    client.close()


def test_an_unanswered_call_is_retried_until_the_deadline_then_names_the_ps():
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    client = PSClient([address], deadline_s=2.5)
    started = time.monotonic()
    with pytest.raises(Exception) as caught:
        client.register({"emb": 2}, {})
    waited = time.monotonic() - started
    assert 2.0 < waited < 6.0, waited
    assert f"PS 0 at {address}: Register not answered for" in str(caught.value)
    assert "(--ps-deadline 2.5)" in str(caught.value)
    client.close()


def test_a_sync_worker_without_the_chiefs_checkpoint_step_is_a_clear_error(tmp_path):
    """A non-chief worker's own checkpoint at the chief's restored step: async workers (steps of their own)
    take their newest at or before it; a sync worker whose save of that step was cut must not go on from
    another step (it would push for a step the others passed)."""
    from deeprec.checkpoint import save_checkpoint
    from deeprec.distributed.ps.client import PSError
    from deeprec.distributed.ps.rollback import _own_checkpoint

    for step in (100, 200):
        save_checkpoint(str(tmp_path), step, {"step": step})
    assert _own_checkpoint(str(tmp_path), 200, "PS 1 restarted", exact=True)[1]["step"] == 200
    assert _own_checkpoint(str(tmp_path), 250, "PS 1 restarted", exact=False)[1]["step"] == 200
    with pytest.raises(PSError, match=r"PS 1 restarted; the chief restored the PSs to step 250, but its newest "
                                      r"checkpoint is of step 200: sync workers go on from one step"):
        _own_checkpoint(str(tmp_path), 250, "PS 1 restarted", exact=True)
