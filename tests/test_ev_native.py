"""The EmbeddingVariable's native path (one op finds, inserts, counts and gathers; one op applies the
optimizer to every variable of a collection) equals the per-variable path, exactly.

An admission filter that admits on first sight (CounterFilter(1)) admits the same keys as no
filter but takes the per-variable path (Python admission, one lookup and one update per variable),
so the two must hold the same rows, values, slots, frequencies, versions and dirty flags."""
import pytest
import torch

from deeprec import optim
from deeprec.nn import CounterFilter, EmbeddingCollection, EmbeddingFeature, EmbeddingVariable, EmbeddingVariableOption

OPTIMIZERS = {"sgd": lambda: optim.SGD(lr=0.1), "adagrad": lambda: optim.Adagrad(lr=0.1),
              "adam": lambda: optim.Adam(lr=0.01), "adamasync": lambda: optim.AdamAsync(lr=0.01),
              "ftrl": lambda: optim.FTRL(lr=0.1, l1=0.01)}
SLOW = EmbeddingVariableOption(filter_option=CounterFilter(1))


def _state(ev: EmbeddingVariable) -> dict:
    live = slice(0, ev.size)
    out = {"keys": ev.keys[live], "weight": ev.weight[live], "freq": ev.freq[live], "version": ev.version[live],
           "dirty": ev.dirty[live]}
    out.update({f"slot.{n}": s[live] for n, s in ev.slots.items()})
    return out


def _assert_same(a: EmbeddingVariable, b: EmbeddingVariable) -> None:
    assert a.size == b.size and a.global_step == b.global_step
    sa, sb = _state(a), _state(b)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def _collection(option) -> EmbeddingCollection:
    torch.manual_seed(0)
    features = [EmbeddingFeature("a", combiner="mean", ev_option=option),
                EmbeddingFeature("b", ev_option=option), EmbeddingFeature("c", ev_option=option, table="a")]
    return EmbeddingCollection(features, 4)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_collections_native_lookup_and_fused_apply_equal_the_per_variable_path(name):
    fast, slow = _collection(None), _collection(SLOW)
    assert all(ev.native_path for ev in fast.lookup.variables) and not slow.lookup.variables[0].native_path
    fast.set_optimizer(OPTIMIZERS[name]())
    slow.set_optimizer(OPTIMIZERS[name]())
    g = torch.Generator().manual_seed(1)
    for step in range(8):  # new keys every step, known ones again, duplicates in a bag, negative keys
        ids = {"a": torch.randint(-3, 40 + 10 * step, (6, 3), generator=g) * 7919,
               "b": torch.randint(0, 30, (6,), generator=g) - 15, "c": torch.randint(0, 50, (6, 2), generator=g)}
        outs = [c(ids) for c in (fast, slow)]
        assert torch.equal(outs[0], outs[1]), step
        weight = torch.randn(outs[0].shape, generator=g)
        for out in outs:
            (out * weight).sum().backward()
    for a, b in zip(fast.lookup.variables, slow.lookup.variables):
        _assert_same(a, b)
    fast.eval(), slow.eval()
    unseen = {"a": torch.tensor([[10**12, 7919]]), "b": torch.tensor([-15]), "c": torch.tensor([[10**13, -1]])}
    with torch.no_grad():
        assert torch.equal(fast(unseen), slow(unseen))
    for a, b in zip(fast.lookup.variables, slow.lookup.variables):
        _assert_same(a, b)  # evaluation inserts and counts nothing


def test_a_free_variables_native_forward_dedups_in_one_call_and_equals_the_per_variable_path():
    fast, slow = EmbeddingVariable(3), EmbeddingVariable(3, ev_option=SLOW)
    for ev in (fast, slow):
        ev.set_optimizer(optim.Adagrad(lr=0.1))
    g = torch.Generator().manual_seed(2)
    for step in range(6):
        ids = torch.randint(0, 20 + 5 * step, (4, 5, 2), generator=g) - 5
        outs = [ev(ids) for ev in (fast, slow)]
        assert outs[0].shape == (4, 5, 2, 3) and torch.equal(outs[0], outs[1])
        weight = torch.randn(outs[0].shape, generator=g)
        for out in outs:
            (out * weight).sum().backward()
    # the same keys (rows in first-seen order here, sorted there): compare key by key
    order_fast, order_slow = torch.argsort(fast.keys[: fast.size]), torch.argsort(slow.keys[: slow.size])
    for name in ("keys", "weight", "freq", "version", "dirty", "slot.accumulator"):
        assert torch.equal(_state(fast)[name][order_fast], _state(slow)[name][order_slow]), name
    fast.eval(), slow.eval()
    probe = torch.tensor([[3, 1000, 3]])
    assert torch.equal(fast(probe), slow(probe))
    assert torch.equal(fast(probe)[0, 1], torch.zeros(3))  # unseen: default_value_no_permission


def test_counting_bloom_filter_positions_equal_uint64_splitmix64():
    """The filter's positions, computed in torch int64 ops, are those of the uint64 arithmetic
    (numpy here as the reference), negative keys and huge moduli included."""
    import numpy as np

    from deeprec.nn.variable import _mix64_mod

    def reference(x, salt, m):
        x = x.astype(np.uint64) + np.uint64((0x9E3779B97F4A7C15 * (salt + 1)) & 0xFFFFFFFFFFFFFFFF)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return ((x ^ (x >> np.uint64(31))) % np.uint64(m)).astype(np.int64)

    keys = torch.cat([torch.randint(-2**63, 2**63 - 1, (20_000,), generator=torch.Generator().manual_seed(3)),
                      torch.arange(-50, 50)])
    for m in (7, 1000, 2**20 + 3, 12_345_678_901):
        for salt in range(3):
            assert np.array_equal(_mix64_mod(keys, salt, m).numpy(), reference(keys.numpy(), salt, m)), (m, salt)
