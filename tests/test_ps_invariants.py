"""The PS keeps its invariants (issue #32, part 3), on real PS processes over loopback: every RPC is checked
whole before it changes anything (INVALID_ARGUMENT naming the field), non-finite values and learning rates
are refused, every allocation counts against --max-memory, an evaluation Pull's reply is chunked under the
server's bound, and a PS dies with its launcher."""
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch

from deeprec.distributed import PSClient
from deeprec.distributed.ps.shard import SERVICE
from deeprec.distributed.ps.wire import pack, unpack

METHODS = ("Register", "Pull", "Push", "PushPull", "Load", "Export", "Health")


@pytest.fixture
def ps():
    started = []

    def make(*extra):
        proc = subprocess.Popen([sys.executable, "-m", "deeprec.distributed.ps", "--bind", "127.0.0.1:0",
                                 "--threads", "2", *extra], stdout=subprocess.PIPE, text=True)
        started.append(proc)
        line = proc.stdout.readline()
        assert "listening on" in line, line
        address = line.split()[-1]
        channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 1 << 30),
                                                          ("grpc.max_send_message_length", 1 << 30)])
        return proc, address, {m: channel.unary_unary(f"/{SERVICE}/{m}") for m in METHODS}

    yield make
    for proc in started:
        proc.kill()
        proc.wait(10)


def refused(call, request, code=grpc.StatusCode.INVALID_ARGUMENT, timeout=30) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=timeout)
    assert info.value.code() == code, info.value.details()
    return info.value.details()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_bad_load_changes_nothing_and_names_its_field(ps):
    proc, address, calls = ps()
    client = PSClient([address], deadline_s=20)
    client.register({"a": 4, "b": 4}, {"w": torch.ones(3)})
    client.pull({"a": torch.arange(10), "b": torch.arange(10)}, ["w"])
    client.push({"a": (torch.arange(10), torch.ones(10, 4)), "w": torch.ones(3)})
    before = client.snapshot()

    def broken(key, value):
        state = dict(before, **{"emb/a/values": before["emb/a/values"] + 1.0})  # a good change first...
        state[key] = value  # ...then a bad field further on
        return pack({}, state)

    cases = [("emb/b/slot.accumulator", torch.zeros(10, 5), "'emb/b/slot.accumulator' is float32 [10, 5]"),
             ("emb/b/values", torch.full((10, 4), float("nan")), "'emb/b/values' holds a non-finite value"),
             ("emb/b/values", torch.full((10, 4), float("inf")), "'emb/b/values' holds a non-finite value"),
             ("emb/b/values", torch.zeros(10, 4, dtype=torch.int64), "'emb/b/values' is int64"),
             ("emb/b/freq", torch.zeros(10), "'emb/b/freq' is float32"),
             ("opt/b", torch.zeros(3, dtype=torch.int64), "'opt/b' must be one int64"),  # was UNKNOWN, half-loaded
             ("opt/w", torch.tensor(-1), "'opt/w' must be one int64"),
             ("dense/w", torch.tensor([1.0, float("nan"), 2.0]), "'dense/w' holds a non-finite value"),
             ("dense_slot/w/accumulator", torch.zeros(4), "'dense_slot/w/accumulator' is float32 [4]"),
             ("emb/b/keys", -torch.arange(1, 11), "'emb/b/keys' must be >= 0")]
    for key, value, message in cases:
        details = refused(calls["Load"], broken(key, value))
        assert message in details and "nothing was changed" in details, (key, details)
        assert same(before, client.snapshot()), key
    assert unpack(calls["Health"](pack({}), timeout=5))[0]["generation"] == 0
    client.restore(dict(before, **{"emb/a/values": before["emb/a/values"] + 1.0}))  # a good Load still works
    assert torch.equal(client.snapshot()["emb/a/values"], before["emb/a/values"] + 1.0)
    assert proc.poll() is None
    client.close()


def test_non_finite_values_and_learning_rates_are_refused(ps):
    _, address, calls = ps()
    register = calls["Register"]
    for lr in (float("inf"), float("-inf"), float("nan"), 0.0, -1.0):
        spec = {"variables": [{"name": "e", "kind": "embedding", "dim": 4, "lr": lr}]}
        details = refused(register, pack(spec))
        assert "variable 'e'" in details and "lr" in details and "finite" in details, details
    spec = {"variables": [{"name": "e", "kind": "embedding", "dim": 2}]}
    assert "'defaults/e' holds a non-finite value" in refused(
        register, pack(spec, {"defaults/e": torch.tensor([[0.0, float("nan")]])}))
    spec = {"variables": [{"name": "w", "kind": "dense"}]}
    details = refused(register, pack(spec, {"init/w": torch.tensor([float("inf")])}))
    assert "'init/w' holds a non-finite value" in details
    twice = {"variables": [{"name": "e", "kind": "embedding", "dim": 2}, {"name": "e", "kind": "dense"}]}
    assert "given twice" in refused(register, pack(twice, {"init/e": torch.zeros(1)}))
    registered = unpack(calls["Register"](pack({"variables": []}), timeout=5))[0]["variables"]
    assert registered == []  # none of them

    client = PSClient([address], deadline_s=20)
    client.register({"e": 2}, {}, optimizer="sgd", lr=1.0)
    rows = client.pull({"e": torch.tensor([1, 2])})["e"]
    push = {"embeddings": ["e"], "dense": []}
    bad = {"keys": torch.tensor([1, 2]), "counts": torch.tensor([2]), "grads/2": torch.tensor([[1.0, 1.0],
                                                                                              [float("nan"), 0.0]])}
    assert "non-finite gradient" in refused(calls["Push"], pack(push, bad))
    assert torch.equal(client.pull({"e": torch.tensor([1, 2])}, train=False)["e"], rows)
    client.close()


def test_push_pull_checks_its_pull_before_the_push_changes_anything(ps):
    _, address, calls = ps()
    client = PSClient([address], deadline_s=20)
    client.register({"e": 2}, {}, optimizer="sgd", lr=1.0)
    rows = client.pull({"e": torch.tensor([1, 2])})["e"]
    header = {"push": {"embeddings": ["e"], "dense": []}, "pull": {"embeddings": ["nope"], "dense": []}}
    tensors = {"push.keys": torch.tensor([1, 2]), "push.counts": torch.tensor([2]), "push.grads/2": torch.ones(2, 2),
               "pull.keys": torch.tensor([3]), "pull.counts": torch.tensor([1])}
    assert "unknown variable 'nope'" in refused(calls["PushPull"], pack(header, tensors))
    assert torch.equal(client.pull({"e": torch.tensor([1, 2])}, train=False)["e"], rows)  # the push was not applied
    client.close()


def test_register_defaults_count_against_max_memory(ps):
    _, address, calls = ps("--max-memory", str(16 << 20))
    spec = {"variables": [{"name": "big", "kind": "embedding", "dim": 64}]}
    huge = torch.randn(1 << 18, 64)  # 64 MiB of initializer rows under a 16 MiB budget (was taken: 0.38 -> 2.7 GB)
    details = refused(calls["Register"], pack(spec, {"defaults/big": huge}), grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "--max-memory" in details and "registering 1 variable" in details
    assert unpack(calls["Register"](pack({"variables": []}), timeout=5))[0]["variables"] == []
    client = PSClient([address], deadline_s=20)  # the budget is intact: 8 MiB of defaults fit...
    client.register({"big": 64}, {}, defaults={"big": huge[: 1 << 15]})
    assert torch.equal(client.pull({"big": torch.tensor([5])})["big"][0], huge[5])
    spec = {"variables": [{"name": "big2", "kind": "embedding", "dim": 64}]}  # ...and are counted: 8 more do not
    refused(calls["Register"], pack(spec, {"defaults/big2": huge[: 1 << 15]}), grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert unpack(calls["Register"](pack({"variables": []}), timeout=5))[0]["variables"] == ["big"]
    client.close()


def test_an_evaluation_pull_is_answered_in_chunks_under_the_servers_bound(ps):
    bound = 256 << 10
    _, address, calls = ps("--max-reply-bytes", str(bound))
    client = PSClient([address], deadline_s=30)
    client.register({"small": 8, "wide": 16}, {"w": torch.arange(6.0)})
    keys = {"small": torch.arange(20_000), "wide": torch.arange(0, 30_000, 3)}
    trained = client.pull(keys)  # a training pull is answered whole (its keys are one batch's)
    # evaluation: the keys trained, and 5,000 never seen (zeros), in another order
    eval_keys = {"small": torch.cat([torch.arange(25_000)]).flip(0), "wide": torch.arange(0, 30_000, 3)}

    sizes = []
    once = client._invoke_once

    def recording(method, ps_index, header, tensors):
        received = client.bytes_received
        reply = once(method, ps_index, header, tensors)
        sizes.append(client.bytes_received - received)
        return reply

    client._invoke_once = recording
    rows = client.pull(eval_keys, ["w"], train=False)
    total = 4 * (25_000 * 8 + 10_000 * 16)
    assert len(sizes) >= total // bound and max(sizes) <= bound, sizes
    assert torch.equal(rows["small"], torch.cat([torch.zeros(5_000, 8), trained["small"].flip(0)]))
    assert torch.equal(rows["wide"], trained["wide"]) and torch.equal(rows["w"], torch.arange(6.0))

    raw = {"keys": torch.cat([eval_keys["small"], eval_keys["wide"]]), "counts": torch.tensor([25_000, 10_000])}
    reply = calls["Pull"](pack({"embeddings": ["small", "wide"], "dense": [], "train": False}, raw), timeout=30)
    header, tensors = unpack(reply)
    assert len(reply) <= bound and 0 < header["rows"] < 35_000
    assert tensors["values/8"].shape[0] == header["rows"]  # the first rows: all of 'small''s dim 8
    client.close()


def test_a_push_pull_evaluation_past_the_bound_is_refused_before_its_push(ps):
    _, address, calls = ps("--max-reply-bytes", str(64 << 10))
    client = PSClient([address], deadline_s=20)
    client.register({"e": 8}, {}, optimizer="sgd", lr=1.0)
    rows = client.pull({"e": torch.arange(4)})["e"]
    header = {"push": {"embeddings": ["e"], "dense": []}, "pull": {"embeddings": ["e"], "dense": [], "train": False}}
    tensors = {"push.keys": torch.arange(4), "push.counts": torch.tensor([4]), "push.grads/8": torch.ones(4, 8),
               "pull.keys": torch.arange(10_000), "pull.counts": torch.tensor([10_000])}
    assert "--max-reply-bytes" in refused(calls["PushPull"], pack(header, tensors), grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert torch.equal(client.pull({"e": torch.arange(4)}, train=False)["e"], rows)
    client.close()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_sigkill_to_launch_leaves_no_ps_running(tmp_path):
    env = dict(os.environ, DEEPREC_CACHE=str(tmp_path))
    launcher = subprocess.Popen([sys.executable, "-m", "deeprec.cli", "launch", "--ps", "1", "--workers", "1", "--",
                                 "train", "--model", "dlrm", "--synthetic", "3000", "--cardinalities", "small",
                                 "--steps", "1000000", "--batch-size", "32"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    kids = []
    try:
        line = launcher.stdout.readline()
        assert "listening on" in line, line
        deadline = time.monotonic() + 60
        while len(kids := _children(launcher.pid)) < 2 and time.monotonic() < deadline:  # the PS, then the worker
            time.sleep(0.1)
        assert len(kids) == 2, kids
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in kids), [pid for pid in kids if _alive(pid)]
    finally:
        for pid in kids:  # a failed test must not leave them running either
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
