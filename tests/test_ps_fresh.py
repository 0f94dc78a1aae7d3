"""A training Pull that leaves out the rows it creates (deeprec/distributed/ps/fresh.py): the worker fills
them from its own initializer matrices and gets exactly the rows a full pull answers; a PS whose matrix
differs, or a request it cannot answer that way, answers in full."""
import torch

from deeprec.distributed import PSClient
from deeprec.distributed.ps.fresh import Initializers
from deeprec.nn.options import InitializerOption

from test_ps_robustness import ps  # noqa: F401  (the fixture)
from test_ps_rows import _grads, _request, _same, _shard


def _pull(state, names, request, omit):
    return state.pull({"embeddings": names, "dense": [], "train": True, **({"omit_fresh": True} if omit else {})},
                      request)


def test_the_filled_rows_equal_a_full_pull_and_the_shards_stay_equal():
    """Two dims (one arena each), keys repeated within a request, pushes between the pulls."""
    full, names = _shard((4, 0.1), (8, 0.2))
    omitting, _ = _shard((4, 0.1), (8, 0.2))
    inits = Initializers()
    for n, d in zip(names, (4, 8)):
        inits.add(n, InitializerOption().matrix(d))
    g = torch.Generator().manual_seed(5)
    table = None
    for step in range(4):
        request = _request(names, g, n=40, high=70)
        want, got = _pull(full, names, request, False), _pull(omitting, names, request, True)
        table = torch.repeat_interleave(torch.arange(len(names)), request["counts"])
        for d, span in ((4, slice(0, 40)), (8, slice(40, 80))):
            fresh = got[f"fresh/{d}"]
            assert fresh.dtype == torch.bool and fresh.numel() == 40
            assert got[f"values/{d}"].shape[0] == 40 - int(fresh.sum())  # only the held rows travel
            if step == 0:
                assert int(fresh.sum()) > 0
            filled = inits.fill(got[f"values/{d}"], fresh, request["keys"][span], names, table[span])
            assert torch.equal(filled, want[f"values/{d}"])
        grads = _grads(full, names, request, g)
        for state in (full, omitting):
            state.push({"embeddings": names, "dense": []}, {**request, **grads})
        _same(full, omitting)


def test_a_dim_whose_rows_come_from_two_arenas_is_answered_in_full():
    state, names = _shard((4, 0.1), (4, 0.3))  # one dim, two learning rates: two arenas
    request = _request(names, torch.Generator().manual_seed(6))
    got = _pull(state, names, request, True)
    assert "fresh/4" not in got and got["values/4"].shape == (80, 4)


def test_over_grpc_the_client_gets_the_full_pulls_rows_with_fewer_bytes(ps):  # noqa: F811
    clients = []
    for omit in (True, False):
        _, address, _ = ps()
        c = PSClient([address], deadline_s=20)
        c.register({"a": 4, "b": 8}, {}, optimizer="adagrad", lr=0.1,
                   defaults={"b": torch.randn(50, 8, generator=torch.Generator().manual_seed(1))})
        if not omit:
            c._fresh_ok = [set()]  # as a worker whose matrices differ from the PS's
        clients.append(c)
    assert clients[0]._fresh_ok == [{"a", "b"}]
    g = torch.Generator().manual_seed(7)
    for step in range(4):
        keys = {n: torch.randint(0, 1000, (60,), generator=g).unique() for n in ("a", "b")}
        rows = [c.pull(keys) for c in clients]
        for n in keys:
            assert torch.equal(rows[0][n], rows[1][n]), (step, n)
        grads = {n: (k, torch.randn(k.numel(), 4 if n == "a" else 8, generator=g)) for n, k in keys.items()}
        for c in clients:
            c.push(grads)
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
    for c in (first, second):
        c.close()
