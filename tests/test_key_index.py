"""The native key index (deeprec/nn/key_index.py over deeprec/csrc/key_index.cpp) against a dict."""
import copy
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deeprec.nn.key_index import KeyIndex, find_rows

_EMPTY = torch.empty(0, dtype=torch.int64)
# few distinct keys and a small table: long probe clusters, wrap-around and many shifts on removal
keys_st = st.lists(st.integers(-2**63, 2**63 - 1) | st.integers(0, 40), max_size=60)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["assign", "remove", "find"]), keys_st), max_size=12))
def test_index_agrees_with_a_dict_through_assigns_removes_and_finds(operations):
    index, model, size = KeyIndex(4), {}, 0
    row_keys = torch.zeros(1000, dtype=torch.int64)
    for op, keys in operations:
        t = torch.tensor(keys, dtype=torch.int64)
        if op == "assign":
            rows = torch.arange(1000, 1000 + t.numel())
            index.assign(t, rows)
            model.update({k: 1000 + i for i, k in enumerate(keys)})
        elif op == "remove":
            assert index.remove(t) == len(set(keys) & set(model))
            for k in keys:
                model.pop(k, None)
        else:
            rows, fresh, repeated = index.find(t, row_keys, size)
            expected = []
            for k in keys:
                if k not in model:
                    model[k] = size
                    size += 1
                expected.append(model[k])
            assert rows.tolist() == expected
            assert repeated == len(keys) - len(set(keys))
            assert row_keys[rows[fresh]].tolist() == t[fresh].tolist()
            assert rows[fresh].tolist() == list(range(size - fresh.numel(), size))
        assert index.entries == len(model)
        _, held, held_rows = index.items()
        assert dict(zip(held.tolist(), held_rows.tolist())) == model
    probe = torch.tensor(list(model) + [123456789], dtype=torch.int64)
    assert index.lookup(probe).tolist() == [model[k] for k in model] + [model.get(123456789, -1)]


def test_dedup_gives_distinct_rows_in_first_seen_order_and_counts_every_position():
    index = KeyIndex()
    row_keys, freq = torch.zeros(16, dtype=torch.int64), torch.zeros(16, dtype=torch.int64)
    keys = torch.tensor([9, 4, 9, 7, 4, 9])
    rows, inverse, fresh, stats = find_rows([index], [row_keys], [freq], [keys], [None], [0], insert=True, dedup=True)
    assert rows[0].tolist() == [0, 1, 2] and inverse[0].tolist() == [0, 1, 0, 2, 1, 0]
    assert fresh[0].tolist() == [0, 1, 2] and stats.tolist() == [[0, 3, 3]]
    assert freq[:3].tolist() == [3, 2, 1] and row_keys[:3].tolist() == [9, 4, 7]
    # known and new keys mixed, counts given: known rows keep their number, new ones follow
    counts = torch.tensor([5, 1, 2])
    rows, inverse, fresh, stats = find_rows([index], [row_keys], [freq], [torch.tensor([7, 11, 7])], [counts], [3],
                                            insert=True, dedup=True)
    assert rows[0].tolist() == [2, 3] and inverse[0].tolist() == [0, 1, 0] and fresh[0].tolist() == [1]
    assert freq[:4].tolist() == [3, 2, 8, 1]
    # not inserting: a key not held reads -1 and keeps a place of its own; nothing is counted
    rows, inverse, _, stats = find_rows([index], [row_keys], [_EMPTY], [torch.tensor([50, 9, 50])], [None], [4],
                                        insert=False, dedup=True)
    assert rows[0].tolist() == [-1, 0, -1] and inverse[0].tolist() == [0, 1, 2] and stats.tolist() == [[2, 0, 3]]
    assert index.lookup(torch.tensor([50])).tolist() == [-1]  # the table is as it was


def test_many_indexes_in_one_call_keep_their_own_rows():
    a, b = KeyIndex(), KeyIndex()
    ka, kb = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    rows, _, fresh, stats = find_rows([a, b], [ka, kb], [_EMPTY, _EMPTY], [torch.tensor([1, 2]), torch.tensor([2])],
                                      [None, None], [0, 5], insert=True, dedup=False)
    assert [r.tolist() for r in rows] == [[0, 1], [5]] and [f.tolist() for f in fresh] == [[0, 1], [0]]
    assert a.lookup(torch.tensor([2])).tolist() == [1] and b.lookup(torch.tensor([1, 2])).tolist() == [-1, 5]


def test_namespaces_separate_equal_keys():
    index = KeyIndex()
    index.assign(torch.tensor([7, 7]), torch.tensor([0, 1]), ns=torch.tensor([0, 3]))
    assert index.lookup(torch.tensor([7, 7, 7]), ns=torch.tensor([3, 0, 1])).tolist() == [1, 0, -1]
    assert index.remove(torch.tensor([7]), ns=torch.tensor([3])) == 1
    assert index.lookup(torch.tensor([7, 7]), ns=torch.tensor([3, 0])).tolist() == [-1, 0]


def test_the_table_grows_past_half_full_and_copies_travel_with_it():
    index = KeyIndex(4)
    keys = torch.randperm(50_000) * 7919
    index.assign(keys, torch.arange(50_000))
    assert index.entries == 50_000 and 2 * index.entries <= index.slots
    for copied in (copy.deepcopy(index), pickle.loads(pickle.dumps(index))):
        assert torch.equal(copied.lookup(keys), torch.arange(50_000))
    index.remove(keys[::2])
    assert torch.equal(index.lookup(keys[1::2]), torch.arange(1, 50_000, 2))
    assert bool((index.lookup(keys[::2]) == -1).all())


def _held(index: KeyIndex) -> dict:
    ns, keys, rows = index.items()
    return dict(zip(zip(ns.tolist(), keys.tolist()), rows.tolist()))


@pytest.mark.parametrize("most", [0, 5000])  # a table grown by copying, and one grown in its reserved space
def test_growing_in_place_keeps_every_entry_clusters_wrapping_around_the_end_too(most):
    wrapped = 0
    for seed in range(60):
        g = torch.Generator().manual_seed(seed)
        index = KeyIndex(4, most=most)  # 16 slots, filled to half: clusters often wrap past the last slot
        n = 8
        ns, keys = torch.randint(0, 3, (n,), generator=g), torch.randint(0, 1 << 62, (n,), generator=g)
        index.assign(keys, torch.arange(n), ns=ns)
        assert index.slots == 16
        wrapped += bool(index.table[-1] >= 0) and bool(index.table[1] >= 0)  # the last and the first slot held
        before = _held(index)
        index.reserve(1 + seed * 30)  # grows 2x, 4x ... 512x
        assert index.slots > 16 and _held(index) == before
        assert torch.equal(index.lookup(keys, ns=ns), torch.arange(n))
        more = torch.randint(0, 1 << 62, (40,), generator=g)  # inserts and removals go on as before
        index.assign(more, torch.arange(n, n + 40))
        assert index.remove(keys[::2], ns=ns[::2].contiguous()) == n // 2
        assert torch.equal(index.lookup(more), torch.arange(n, n + 40))
        assert torch.equal(index.lookup(keys[1::2], ns=ns[1::2].contiguous()), torch.arange(1, n, 2))
    assert wrapped >= 5  # the case the growth takes apart was met


def test_a_reserved_index_grows_in_its_own_space_and_its_copies_hold_only_the_table():
    index = KeyIndex(4, most=100_000)
    start = index.table.data_ptr()
    keys = torch.randperm(30_000) * 7919
    index.assign(keys, torch.arange(30_000))
    assert index.table.data_ptr() == start and index.slots == 65536  # grown in place, never copied
    blob = pickle.dumps(index)
    assert len(blob) < 3 * index.nbytes()  # not the address space reserved for 100k entries
    for copied in (copy.deepcopy(index), pickle.loads(blob)):
        assert torch.equal(copied.lookup(keys), torch.arange(30_000))
        copied.assign(torch.tensor([-5]), torch.tensor([7]))  # a copy grows on its own
        assert copied.lookup(torch.tensor([-5])).tolist() == [7] and index.lookup(torch.tensor([-5])).tolist() == [-1]
    index.reserve(200_000)  # past its reserved space: grows into a new tensor
    assert index.slots == 524288 and torch.equal(index.lookup(keys), torch.arange(30_000))
