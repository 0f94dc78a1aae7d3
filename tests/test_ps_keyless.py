"""A push that sends no keys, only the seq of the same client's last training pull ("pulled"):
it must leave the shard exactly as the push of those keys does, and be refused (nothing
changed) whenever the PS no longer holds that pull, which PSClient then sends again with its keys."""
import grpc
import pytest
import torch

from deeprec.distributed import PSClient
from deeprec.distributed.ps import client as client_module
from deeprec.distributed.ps.pulled import PullNotHeld
from deeprec.distributed.ps.wire import WireError

from test_ps_robustness import ps  # noqa: F401  (the fixture)
from test_ps_rows import _grads, _request, _same, _shard, pulled_then_pushed


def _pull(state, names, request, client, seq):
    return state.pull({"embeddings": names, "dense": [], "client": client, "seq": seq}, request)


def _keyless(state, names, grads, client, pulled, **extra):
    state.push({"embeddings": names, "dense": [], "client": client, "pulled": pulled, **extra}, grads)


def test_a_keyless_push_equals_a_push_whose_keys_are_looked_up():
    pulled_then_pushed(lambda shard, names, seq, request, grads: _keyless(shard, names, grads, "w0", seq))


def test_sync_keyless_pushes_equal_keyed_ones_and_another_clients_pull_changes_nothing():
    keyless, names = _shard((8, 0.1), (16, 0.2))
    keyed, _ = _shard((8, 0.1), (16, 0.2))
    g = torch.Generator().manual_seed(1)
    current = [_request(names, g), _request(names, g)]
    for w in range(2):
        _pull(keyless, names, current[w], f"w{w}", 1)
        _pull(keyed, names, current[w], f"w{w}", 1)
    for step in range(1, 4):  # sync: two workers, each push averaged with the other's
        for w in range(2):
            grads = _grads(keyless, names, current[w], g)
            _keyless(keyless, names, grads, f"w{w}", step, step=step, workers=2)
            keyed.push({"embeddings": names, "dense": [], "step": step, "workers": 2}, {**current[w], **grads})
            current[w] = _request(names, g)
            _pull(keyless, names, current[w], f"w{w}", step + 1)  # w1's pull comes between w0's pull and push
            _pull(keyed, names, current[w], f"w{w}", step + 1)
        _same(keyless, keyed)


def test_a_keyless_push_the_ps_cannot_place_is_refused_and_changes_nothing():
    state, names = _shard((4, 0.1), (4, 0.1))
    g = torch.Generator().manual_seed(2)
    request = _request(names, g)
    grads = _grads(state, names, request, g)
    before = state.export()

    def unchanged():
        after = state.export()
        assert all(torch.equal(before[k], after[k]) for k in before)

    with pytest.raises(PullNotHeld, match="none of its pulls"):
        _keyless(state, names, grads, "w0", 1)
    _pull(state, names, request, "w0", 1)
    before = state.export()
    with pytest.raises(PullNotHeld, match="its last pull is 1"):
        _keyless(state, names, grads, "w0", 2)
    with pytest.raises(PullNotHeld, match="none of its pulls"):  # another client's pull is not its own
        _keyless(state, names, grads, "w1", 1)
    with pytest.raises(WireError, match="carries no 'keys'"):
        state.push({"embeddings": names, "dense": [], "client": "w0", "pulled": 1}, {**request, **grads})
    with pytest.raises(WireError, match="'embeddings' must name the variables of pull 1"):
        _keyless(state, names[::-1], grads, "w0", 1)
    with pytest.raises(WireError, match="grads/4"):  # wrong gradients: checked before the pull's rows are taken
        _keyless(state, names, {"grads/4": grads["grads/4"][1:]}, "w0", 1)
    with pytest.raises(WireError, match="'pulled' must be an int"):
        _keyless(state, names, grads, "w0", "1")
    unchanged()
    _keyless(state, names, grads, "w0", 1)  # still held after the refusals: applied now
    with pytest.raises(PullNotHeld, match="none of its pulls"):  # taken: a second one is refused
        _keyless(state, names, grads, "w0", 1)
    _pull(state, names, request, "w0", 3)
    state.load(state.export())  # a Load renumbers the rows
    before = state.export()
    with pytest.raises(PullNotHeld, match="does not hold"):  # a Load forgets every pull's rows
        _keyless(state, names, grads, "w0", 3)
    unchanged()


def test_the_client_pushes_pulled_keys_without_them_and_falls_back_to_keys(ps, monkeypatch):  # noqa: F811
    """Over gRPC: a keyless client and a keyed one, each on its own PS, end equal; a keyless push the PS
    refuses (NOT_FOUND) is sent again with its keys and applied once."""
    clients = []
    for keyless in (True, False):
        _, address, _ = ps()
        c = PSClient([address], deadline_s=20)
        c.register({"a": 4, "b": 8}, {}, optimizer="adagrad", lr=0.1)
        clients.append(c)
    sent = []
    once = clients[0]._invoke_once
    clients[0]._invoke_once = lambda method, p, header, tensors: sent.append((method, header, set(tensors))) or \
        once(method, p, header, tensors)
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        keys = {n: torch.randint(0, 1000, (50,), generator=g).unique() for n in ("a", "b")}
        grads = {n: (k, torch.randn(k.numel(), 4 if n == "a" else 8, generator=g)) for n, k in keys.items()}
        for i, c in enumerate(clients):
            c.pull(keys)
            if step == 2 and i == 0:  # the PS holds pull seq s; the client says s - 1: refused, resent
                c._pulls._kept[0] = (c._pulls._kept[0][0] - 1, *c._pulls._kept[0][1:])
            if i == 1:
                monkeypatch.setattr(client_module, "same_keys", lambda *a: False)
            c.push(grads)
            monkeypatch.undo()
    pushes = [(h, t) for m, h, t in sent if m == "Push"]
    assert ["pulled" in h for h, _ in pushes] == [True, True, True, False, True]  # step 2: refused, then keyed
    assert all(("keys" in t) != ("pulled" in h) for h, t in pushes)
    a, b = clients[0].snapshot(), clients[1].snapshot()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for c in clients:
        c.close()


def test_a_refused_keyless_push_is_not_found_over_grpc(ps):  # noqa: F811
    from deeprec.distributed.ps.wire import pack

    _, address, calls = ps()
    client = PSClient([address], deadline_s=20)
    client.register({"e": 2}, {}, optimizer="sgd", lr=1.0)
    try:
        calls["Push"](pack({"embeddings": ["e"], "dense": [], "client": "x", "seq": 1, "pulled": 7},
                           {"grads/2": torch.ones(1, 2)}), timeout=10)
        raise AssertionError("a keyless push with no pull was applied")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.NOT_FOUND and "send the keys" in err.details(), err
    client.close()


def test_a_ps_that_does_not_say_it_kept_the_pull_gets_keyed_pushes_only(ps):  # noqa: F811
    """An older PS, or tiered storage, answers a pull without "kept": every push goes with its keys, once
    (no refused keyless call, no second send); the PS's reply says "kept" with the pull's seq otherwise."""
    _, address, _ = ps()
    client = PSClient([address], deadline_s=20)
    client.register({"a": 4}, {}, optimizer="adagrad", lr=0.1)
    sent, once = [], client._invoke_once

    def forgetful(method, p, header, tensors):
        reply = once(method, p, header, tensors)
        sent.append((method, header, reply[0]))
        return ({k: v for k, v in reply[0].items() if k != "kept"}, reply[1]) if method == "Pull" else reply

    client._invoke_once = forgetful
    keys = {"a": torch.arange(10)}
    for _ in range(3):
        client.pull(keys)
        client.push({"a": (keys["a"], torch.ones(10, 4))})
    pulls = [(h, r) for m, h, r in sent if m == "Pull"]
    assert all(r.get("kept") == h["seq"] for h, r in pulls)  # the PS kept each (an arena of its own)
    assert [m for m, _, _ in sent] == ["Pull", "Push"] * 3
    assert not any("pulled" in h for m, h, _ in sent if m == "Push")
    client.close()
