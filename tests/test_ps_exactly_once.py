"""Exactly-once retries at the PS (issue 28): what it keeps of a client's replies, and what it does
with a retry whose reply it no longer keeps."""
from __future__ import annotations

import grpc
import pytest
import torch

from deeprec.distributed import PSClient
from deeprec.distributed.ps.shard import REPLAYS
from deeprec.distributed.ps.wire import pack, unpack

from test_ps_robustness import ps, status  # noqa: F401  (ps: the fixture)


def _push(seq: int, done: int = 0, client: str = "w0") -> bytes:
    return pack({"embeddings": ["emb"], "dense": [], "client": client, "seq": seq, "done": done},
                {"keys": torch.tensor([7]), "counts": torch.tensor([1]), "grads/2": torch.ones(1, 2)})


def _row(client: PSClient) -> torch.Tensor:
    return client.pull({"emb": torch.tensor([7])}, train=False)["emb"][0]


def test_a_retry_whose_reply_was_dropped_is_refused_not_run_twice(ps):  # noqa: F811
    _, address, calls = ps()
    client = PSClient([address], deadline_s=20)
    client.register({"emb": 2}, {}, optimizer="sgd", lr=1.0)
    start = client.pull({"emb": torch.tensor([7])})["emb"][0]  # a training pull: the row exists
    assert status(calls["Push"], _push(1))[1] is None
    assert status(calls["Push"], _push(1))[1] is None  # kept: answered again, not run
    assert status(calls["Push"], _push(2, done=1))[1] is None  # the client is done with 1: its reply is dropped
    _, err = status(calls["Push"], _push(1, done=1))
    assert err.code() == grpc.StatusCode.ABORTED, err
    assert "request 1 of client w0 may have run already" in err.details() and "not run a second time" in err.details()
    for seq in range(3, 3 + REPLAYS):  # a client that never says it is done: the oldest beyond REPLAYS dropped
        assert status(calls["Push"], _push(seq, done=1))[1] is None
    _, err = status(calls["Push"], _push(2, done=1))
    assert err.code() == grpc.StatusCode.ABORTED, err
    assert torch.allclose(_row(client), start - (2 + REPLAYS)), (_row(client), start)  # each push once
    client.close()


@pytest.mark.slow
def test_a_retried_load_is_taken_once(ps):  # noqa: F811
    """A Load whose reply was lost and that is sent again must not restore twice: a second restore
    would roll back the workers that already went on after the first."""
    _, address, calls = ps()
    client = PSClient([address], deadline_s=20)
    client.register({"emb": 2}, {}, optimizer="sgd", lr=1.0)
    sent = []
    once = client._invoke_once
    client._invoke_once = lambda method, p, header, tensors: sent.append((method, header, tensors)) or \
        once(method, p, header, tensors)
    client.restore(client.snapshot(), step=3)
    method, header, tensors = sent[-1]
    assert method == "Load" and "seq" in header, header
    again = once(method, 0, header, tensors)[0]  # its retry, as after a lost reply
    health = unpack(calls["Health"](pack({}), timeout=5))[0]
    assert client.expect[0][1] == again["generation"] == health["generation"] == 1, (client.expect, again, health)
    client.close()


@pytest.mark.slow
def test_the_client_says_which_replies_it_is_done_with(ps):  # noqa: F811
    """PSClient's calls carry "done": the PS keeps no reply of a call that was answered."""
    _, address, _ = ps()
    client = PSClient([address], deadline_s=20)
    client.register({"emb": 2}, {}, optimizer="sgd", lr=1.0)
    sent = []
    once = client._invoke_once
    client._invoke_once = lambda method, p, header, tensors: sent.append(header) or once(method, p, header, tensors)
    for _ in range(3):
        client.pull({"emb": torch.tensor([1, 2])})
        client.push({"emb": (torch.tensor([1, 2]), torch.ones(2, 2))})
    seqs = [(h["seq"], h["done"]) for h in sent if "seq" in h]
    assert seqs == [(s, s - 1) for s in range(1, 7)], seqs  # one call at a time: all before it are done
    assert not client._waiting
    client.close()
