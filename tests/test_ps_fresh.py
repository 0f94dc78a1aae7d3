"""A training Pull that leaves out the rows it creates (deeprec/distributed/ps/fresh.py): the worker fills
them from its own initializer matrices and gets exactly the rows a full pull answers; a PS whose matrix
differs, or a request it cannot answer that way, answers in full."""
import pytest
import torch

from deeprec.distributed import PSClient
from deeprec.distributed.ps.fresh import Initializers
from deeprec.nn.options import InitializerOption

from test_ps_robustness import ps  # noqa: F401  (the fixture)
from test_ps_rows import _grads, _request, _same, _shard


def _pull(state, names, request, digest=None):
    return state.pull({"embeddings": names, "dense": [], "train": True,
                       **({"omit_fresh": digest} if digest else {})}, request)


def _defaults(names, dims) -> Initializers:
    inits = Initializers()
    for n, d in zip(names, dims):
        inits.add(n, InitializerOption().matrix(d))
    return inits


def test_the_filled_rows_equal_a_full_pull_and_the_shards_stay_equal():
    """Two dims (one arena each), keys repeated within a request, pushes between the pulls."""
    full, names = _shard((4, 0.1), (8, 0.2))
    omitting, _ = _shard((4, 0.1), (8, 0.2))
    inits = _defaults(names, (4, 8))
    g = torch.Generator().manual_seed(5)
    for step in range(4):
        request = _request(names, g, n=40, high=70)
        want, got = _pull(full, names, request), _pull(omitting, names, request, inits.digest(names))
        table = torch.repeat_interleave(torch.arange(len(names)), request["counts"])
        for d, span in ((4, slice(0, 40)), (8, slice(40, 80))):
            fresh = got[f"fresh/{d}"]
            assert fresh.dtype == torch.bool and fresh.numel() == 40
            assert got[f"values/{d}"].shape[0] == 40 - int(fresh.sum())  # only the held rows travel
            if step == 0:
                assert int(fresh.sum()) > 0
            filled = inits.fill(got[f"values/{d}"], fresh, request["keys"][span], names, table[span], d)
            assert torch.equal(filled, want[f"values/{d}"])
        grads = _grads(full, names, request, g)
        for state in (full, omitting):
            state.push({"embeddings": names, "dense": []}, {**request, **grads})
        _same(full, omitting)


def test_a_dim_whose_rows_come_from_two_arenas_is_answered_in_full():
    state, names = _shard((4, 0.1), (4, 0.3))  # one dim, two learning rates: two arenas
    request = _request(names, torch.Generator().manual_seed(6))
    got = _pull(state, names, request, _defaults(names, (4, 4)).digest(names))
    assert "fresh/4" not in got and got["values/4"].shape == (80, 4)


def test_a_pull_whose_digest_differs_from_the_ps_s_is_answered_in_full():
    """The PS checks the worker's digest with every pull: other matrices (another worker registered
    first, a restarted PS) get every row."""
    state, names = _shard((4, 0.1), (4, 0.1))
    request = _request(names, torch.Generator().manual_seed(8))
    other = Initializers()
    for n in names:
        other.add(n, torch.ones(10, 4))
    for digest in (other.digest(names), "x"):
        got = _pull(state, names, request, digest)
        assert "fresh/4" not in got and got["values/4"].shape == (80, 4)
    assert "fresh/4" in _pull(state, names, _request(names, torch.Generator().manual_seed(9), high=1000),
                              _defaults(names, (4, 4)).digest(names))


def test_a_reply_that_cannot_fit_its_request_is_refused_naming_it():
    inits = _defaults(["a"], (4,))
    keys, table = torch.arange(5), torch.zeros(5, dtype=torch.int64)
    fresh = torch.tensor([True, False, True, False, False])
    with pytest.raises(ValueError, match=r"fresh/4 must be bool \[5\]"):
        inits.fill(torch.zeros(3, 4), fresh[:4], keys, ["a"], table, 4)
    with pytest.raises(ValueError, match=r"values/4 must be \[3, 4\]"):
        inits.fill(torch.zeros(2, 4), fresh, keys, ["a"], table, 4)
    with pytest.raises(ValueError, match="initializer this worker lacks"):
        inits.fill(torch.zeros(3, 4), fresh, keys, ["b"], table, 4)
    filled = inits.fill(torch.ones(3, 4), fresh, keys, ["a"], table, 4)
    assert torch.equal(filled[1], torch.ones(4)) and torch.equal(filled[2], inits.matrices[4][2])


@pytest.mark.parametrize("protocol,num_ps", [("star_server", 1), ("star_server", 2), ("star_server_lite", 2),
                                              ("grpc", 2)])
def test_over_grpc_the_client_gets_the_full_pulls_rows_with_fewer_bytes(ps, protocol, num_ps):  # noqa: F811
    clients = []
    for omit in (True, False):
        addresses = [ps()[1] for _ in range(num_ps)]
        c = PSClient(addresses, protocol, deadline_s=20)
        c.register({"a": 4, "b": 8}, {}, optimizer="adagrad", lr=0.1,
                   defaults={"b": torch.randn(50, 8, generator=torch.Generator().manual_seed(1))})
        if not omit:
            c._fresh_ok = [set()] * num_ps  # as a worker whose matrices differ from the PS's
        clients.append(c)
    assert clients[0]._fresh_ok == [{"a", "b"}] * num_ps
    g = torch.Generator().manual_seed(7)
    keys = {n: torch.randint(0, 1000, (60,), generator=g).unique() for n in ("a", "b")}
    rows = [c.pull(keys) for c in clients]
    for step in range(4):
        for n in keys:
            assert torch.equal(rows[0][n], rows[1][n]), (step, n)
        grads = {n: (k, torch.randn(k.numel(), 4 if n == "a" else 8, generator=g)) for n, k in keys.items()}
        keys = {n: torch.randint(0, 1000, (60,), generator=g).unique() for n in ("a", "b")}
        rows = [c.push_pull(grads, keys) for c in clients]
    assert clients[0].bytes_received < 0.6 * clients[1].bytes_received
    for c in clients:
        c.close()


def test_a_worker_whose_matrix_differs_from_the_ps_s_asks_in_full(ps):  # noqa: F811
    """The first registration's matrix stays on the PS: a second worker with other values gets the PS's rows."""
    _, address, _ = ps()
    first, second = PSClient([address], deadline_s=20), PSClient([address], deadline_s=20)
    first.register({"e": 4}, {}, defaults={"e": torch.ones(10, 4)})
    second.register({"e": 4}, {}, defaults={"e": torch.zeros(10, 4)})
    assert first._fresh_ok == [{"e"}] and second._fresh_ok == [set()]
    sent, once = [], second._invoke_once
    second._invoke_once = lambda method, p, header, tensors: sent.append(header) or once(method, p, header, tensors)
    rows = second.pull({"e": torch.arange(5)})["e"]
    assert torch.equal(rows, torch.ones(5, 4))  # the PS's initial values, not this worker's
    assert "omit_fresh" not in sent[-1]
    second._fresh_ok = [{"e"}]  # a stale belief (as after a restart): the PS checks the digest and answers in full
    rows = second.pull({"e": torch.arange(5, 10)})["e"]
    assert sent[-1]["omit_fresh"] == second.initializers.digest(["e"])
    assert torch.equal(rows, torch.ones(5, 4))
    for c in (first, second):
        c.close()
