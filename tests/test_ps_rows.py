"""The PS arena's native row ops (deeprec/csrc/ps_rows.cpp) and a push taking the rows its pull found.

ps_init_rows / ps_gather_rows must equal the torch composition they replace, bit for bit; a push
of the keys of the same client's last training pull takes that pull's rows (no second lookup),
and anything else (other keys, another client, a Load since) is looked up as before: every
sequence below leaves the shard exactly as a shard that looks every push up."""
import pytest
import torch

from deeprec.distributed.ps.state import ShardState
from deeprec.distributed.ps.store import EmbeddingArena
from deeprec.optim import sparse


@pytest.mark.parametrize("dim,optimizer", [(16, "adagrad"), (3, "adamasync"), (8, "ftrl"), (64, "sgd"), (5, "adam")])
def test_new_rows_and_gather_equal_the_torch_composition(dim, optimizer):
    g = torch.Generator().manual_seed(dim)
    arena = EmbeddingArena(dim, sparse.row_sparse_optimizer(optimizer, 0.1), capacity=8)
    defaults = [torch.randn(n, dim, generator=g) for n in (7, 1, 300)]
    for i, d in enumerate(defaults):
        arena.add(f"v{i}", d)
    arena.optimizer.step_count = 5
    ns = torch.randint(0, 3, (2000,), generator=g)
    keys = torch.randint(0, 1 << 40, (2000,), generator=g) % torch.tensor([1 << 40, 50, 999])[ns]  # repeats
    rows, repeated = arena.rows(ns, keys, insert=True)
    assert repeated > 0 and arena.size < 2000
    held = rows.unique()
    var, key = arena.row_ns[held], arena.row_keys[held]
    expected = torch.stack([defaults[v][k % defaults[v].shape[0]] for v, k in zip(var.tolist(), key.tolist())])
    assert torch.equal(arena.weight[held], expected)
    assert torch.equal(arena.version[held], torch.full_like(held, 5))
    for name, (value, per_element) in arena.optimizer.slot_specs().items():
        assert torch.equal(arena.slots[name][held], torch.full((held.numel(), dim) if per_element else (held.numel(),),
                                                               float(value))), name
    first = {}  # every place's row holds its own (variable, key)
    for r, v, k in zip(rows.tolist(), ns.tolist(), keys.tolist()):
        assert first.setdefault((v, k), r) == r
        assert (int(arena.row_ns[r]), int(arena.row_keys[r])) == (v, k)
    some = torch.cat([rows[torch.randperm(2000, generator=g)[:500]], torch.tensor([-1, -1])])
    assert torch.equal(arena.gather(some), torch.cat([arena.weight[some[:-2]], torch.zeros(2, dim)]))
    out = torch.full((502, dim), 7.0)
    assert arena.gather(some, out=out) is out and torch.equal(out, arena.gather(some))


def test_the_ops_check_every_argument_before_writing():
    arena = EmbeddingArena(4, sparse.Adagrad(lr=0.1), capacity=8)
    arena.add("v", torch.ones(3, 4))
    weight = arena.weight.clone()
    args = dict(fresh=torch.tensor([0, 1]), ns=torch.tensor([0, 0]), keys=torch.tensor([4, 5]), start=0,
                row_ns=arena.row_ns, weight=arena.weight, version=arena.version, step=1,
                slots=list(arena.slots.values()), slot_values=[0.1], defaults=arena._default_matrix,
                offset=arena._default_offset, count=arena._default_count)
    for bad in (dict(fresh=torch.tensor([0, 2])), dict(ns=torch.tensor([0, 1])), dict(start=7),
                dict(count=torch.tensor([4])), dict(slot_values=[])):
        with pytest.raises(RuntimeError, match="ps_init_rows"):
            torch.ops.deeprec.ps_init_rows(**{**args, **bad})
        assert torch.equal(arena.weight.view(torch.int32), weight.view(torch.int32))  # bitwise: rows never written hold whatever memory held, NaN included
    with pytest.raises(RuntimeError, match="ps_gather_rows: a row is out of range"):
        arena.gather(torch.tensor([0, arena.capacity]))
    with pytest.raises(RuntimeError, match="ps_gather_rows: out must be"):
        arena.gather(torch.tensor([0, 1]), out=torch.empty(3, 4))


def _shard(*dims_lrs):
    s = ShardState(0, 1)
    names = [f"t{i}" for i in range(len(dims_lrs))]
    s.register({"variables": [{"name": n, "kind": "embedding", "dim": d, "optimizer": "adagrad", "lr": lr}
                              for n, (d, lr) in zip(names, dims_lrs)]}, {})
    return s, names


def _request(names, g, n=40, high=60):
    keys = [torch.randint(0, high, (n,), generator=g) for _ in names]  # repeats within a variable too
    return {"keys": torch.cat(keys), "counts": torch.tensor([k.numel() for k in keys])}


def _grads(state, names, request, g):
    dims = [state.embeddings[n][0].dim for n in names]
    out = {}
    for d in dict.fromkeys(dims):
        n = sum(int(c) for c, dd in zip(request["counts"], dims) if dd == d)
        out[f"grads/{d}"] = torch.randn(n, d, generator=g)
    return out


def _same(a: ShardState, b: ShardState):
    ea, eb = a.export(), b.export()
    assert ea.keys() == eb.keys()
    for k in ea:
        assert torch.equal(ea[k], eb[k]), k


def _counting_lookups(state, calls=None):
    """The index lookups of `state`'s arenas, as they happen (True: inserting)."""
    calls = [] if calls is None else calls
    for arena in state.arenas.values():
        find = arena.index.find

        def counted(keys, *args, _find=find, **kwargs):
            calls.append(kwargs.get("insert", True))
            return _find(keys, *args, **kwargs)
        arena.index.find = counted
    return calls


def pulled_then_pushed(push) -> None:
    """Six steps of a pull and a push of its keys on one shard beside a shard that looks every key up:
    `push(shard, names, seq, request, grads)` pushes the first's (its pull was `seq` of client w0). The
    push takes the pull's rows (no lookup) and both shards end equal, step by step."""
    # two arenas of dim 2 (other lrs) and one of dim 3: a request's parts and their positions
    fast, names = _shard((2, 0.1), (3, 0.1), (2, 0.05))
    slow, _ = _shard((2, 0.1), (3, 0.1), (2, 0.05))
    lookups = _counting_lookups(fast)
    g = torch.Generator().manual_seed(0)
    header = {"embeddings": names, "dense": []}
    for step in range(6):
        request = _request(names, g)
        grads = _grads(fast, names, request, g)
        a = fast.pull({**header, "client": "w0", "seq": step}, request)
        b = slow.pull(header, request)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        del lookups[:]
        push(fast, names, step, request, grads)
        slow.push(header, {**request, **grads})
        assert lookups == []  # every part took its pull's rows
        _same(fast, slow)


def test_a_push_of_the_pulled_keys_takes_their_rows_and_equals_a_lookup():
    pulled_then_pushed(lambda shard, names, seq, request, grads: shard.push(
        {"embeddings": names, "dense": [], "client": "w0"}, {**request, **grads}))


def test_other_keys_another_client_or_a_load_since_are_looked_up():
    fast, names = _shard((4, 0.1), (4, 0.1))
    slow, _ = _shard((4, 0.1), (4, 0.1))
    lookups = _counting_lookups(fast)
    g = torch.Generator().manual_seed(1)
    header = {"embeddings": names, "dense": []}

    def both(method, request, fast_client=None, slow_state=slow):
        for s, client in ((fast, fast_client), (slow_state, None)):
            getattr(s, method)({**header, **({"client": client} if client else {})}, request)

    pulled = _request(names, g)
    both("pull", pulled, "w0")
    both("pull", _request(names, g), "w1")
    # w0 pushes keys of the same count but in another order: its pull's rows would misplace them
    shuffled = {"keys": pulled["keys"].flip(0), "counts": pulled["counts"].flip(0)}
    del lookups[:]
    both("push", {**shuffled, **_grads(fast, names, shuffled, g)}, "w0")
    _same(fast, slow)
    assert lookups == [False]  # looked up (one arena: one call)
    both("pull", pulled, "w0")
    del lookups[:]
    both("push", {**pulled, **_grads(fast, names, pulled, g)}, "w2")  # another client's push of those keys
    _same(fast, slow)
    assert lookups == [False]
    # a Load renumbers the rows: a pull before it, its push after it, must find the rows again
    saved = slow.export()
    trimmed = {k: (v[: v.shape[0] // 2] if k.startswith("emb/") and v.dim() > 0 else v) for k, v in saved.items()}
    both("pull", pulled, "w0")
    fast.load(trimmed)
    slow.load(trimmed)
    _counting_lookups(fast, lookups)  # the Load rebuilt the arenas' indexes
    del lookups[:]
    both("push", {**pulled, **_grads(fast, names, pulled, g)}, "w0")
    _same(fast, slow)
    assert lookups == [False]


def test_push_pull_and_sync_pushes_take_the_rows_their_pulls_found():
    fast, names = _shard((8, 0.1), (16, 0.2))
    slow, _ = _shard((8, 0.1), (16, 0.2))
    g = torch.Generator().manual_seed(2)
    header = {"embeddings": names, "dense": []}
    current = [_request(names, g), _request(names, g)]
    for w in range(2):
        fast.pull({**header, "client": f"w{w}"}, current[w])
        slow.pull(header, current[w])
    for step in range(1, 4):  # sync: two workers, each push is averaged with the other's
        for w in range(2):
            push = {**current[w], **_grads(fast, names, current[w], g)}
            head = {**header, "step": step, "workers": 2}
            fast.push(head, push, client=f"w{w}")
            slow.push(head, push)
            current[w] = _request(names, g)
            fast.pull({**header, "client": f"w{w}"}, current[w])
            slow.pull(header, current[w])
        _same(fast, slow)
    # star_server_lite's PushPull: the client comes with the call, not in its sections
    request, lookups = _request(names, g), _counting_lookups(fast)
    push = {**current[0], **_grads(fast, names, current[0], g)}
    for s, client in ((fast, "w0"), (slow, None)):
        plan = s.pull_plan(header, request, client=client)
        s.push(header, push, client=client)
        s.pull_run(plan)
    assert lookups == [True, True]  # the pull's, not the push's
    _same(fast, slow)


@pytest.mark.parametrize("num_shards", [1, 3])
def test_request_ns_equals_the_torch_checks_it_replaces(num_shards):
    g = torch.Generator().manual_seed(num_shards)
    for trial in range(50):
        counts = torch.randint(0, 6, (4,), generator=g)
        keys = torch.randint(-3 if trial % 3 == 0 else 0, 5000, (int(counts.sum()),), generator=g)
        if trial % 5 == 1:
            counts[1] += 1  # not the keys' number
        if trial % 7 == 2:
            counts[0] = -1
        ids = torch.randint(0, 9, (4,), generator=g)
        ns, status = torch.ops.deeprec.ps_request_ns(keys, counts, ids, num_shards, 1 % num_shards, 1000)
        fits, negative, wrong = status.tolist()
        assert fits == (bool((counts >= 0).all()) and int(counts.sum()) == keys.numel())
        if not fits:
            continue
        assert torch.equal(ns, torch.repeat_interleave(ids, counts))
        bad = torch.nonzero(keys < 0).squeeze(1)
        assert negative == (int(bad[0]) if bad.numel() else -1)
        other = torch.nonzero(torch.remainder(torch.remainder(keys, 1000), num_shards) != 1 % num_shards).squeeze(1)
        assert wrong == (int(other[0]) if negative < 0 and other.numel() else -1)


def test_finite_prefix_ends_at_the_first_nan_or_inf_of_every_float_dtype():
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for n in (0, 1, 17, 40_000):
            t = torch.randn(n, generator=g).to(dtype) * 1e3
            assert torch.ops.deeprec.ps_finite_prefix(t) == n
            for bad in (float("nan"), float("inf"), -float("inf")):
                if not n:
                    continue
                at = sorted(torch.randint(0, n, (2,), generator=g).tolist())
                u = t.clone()
                u[at[1]] = bad
                u[at[0]] = bad
                assert torch.ops.deeprec.ps_finite_prefix(u) == at[0]
                assert torch.ops.deeprec.ps_finite_prefix(torch.stack([u, u], 1)[:, 0]) == at[0]  # not contiguous
    assert torch.ops.deeprec.ps_finite_prefix(torch.tensor([torch.finfo(torch.float32).max, 0.0])) == 2


@pytest.mark.parametrize("optimizer", ["adagrad", "adamasync", "ftrl", "sgd", "adam"])
def test_an_arena_step_equals_the_optimizer_update_then_the_version_stamp(optimizer):
    g = torch.Generator().manual_seed(4)
    arenas = [EmbeddingArena(6, sparse.row_sparse_optimizer(optimizer, 0.1), capacity=8) for _ in range(2)]
    for arena in arenas:
        arena.add("v", torch.randn(5, 6, generator=torch.Generator().manual_seed(0)))
        arena.rows(torch.zeros(300, dtype=torch.int64), torch.arange(300), insert=True)
    fused, composed = arenas
    for step in range(3):
        rows = torch.cat([torch.randperm(300, generator=g)[:100], torch.tensor([-1])])
        grad = torch.randn(101, 6, generator=g)
        fused.apply(rows, grad, repeated=False)
        known = rows >= 0  # the torch composition the arena ran before (csrc/sparse_optim.cpp's ev_apply_ now)
        composed.optimizer.begin_step()
        composed.optimizer.update(composed.weight, composed.slots, rows[known], grad[known])
        composed.version[rows[known]] = composed.optimizer.step_count
        size = fused.size
        assert torch.equal(fused.weight[:size], composed.weight[:size])
        assert torch.equal(fused.version[:size], composed.version[:size])
        for name in fused.slots:
            assert torch.equal(fused.slots[name][:size], composed.slots[name][:size]), name
