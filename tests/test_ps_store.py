"""The PS shard's fused storage: one key index and arena for many variables, one flat dense buffer."""
import pytest
import torch

from deeprec.distributed.ps.state import ShardState
from deeprec.distributed.ps.store import DenseGroup, EmbeddingArena
from deeprec.optim import sparse


def test_index_gives_each_variable_its_own_rows_and_reports_repeats():
    arena = EmbeddingArena(2, sparse.SGD(lr=1.0), capacity=4)
    a, b = arena.add("a", torch.zeros(1, 2)), arena.add("b", torch.ones(1, 2))
    rows, repeated = arena.rows(torch.tensor([a, b, a, a]), torch.tensor([7, 7, 8, 7]), insert=True)
    assert rows.tolist() == [0, 1, 2, 0] and repeated == 1  # same key, other variable: another row
    assert torch.equal(arena.gather(rows[:2]), torch.tensor([[0.0, 0.0], [1.0, 1.0]]))  # each its initializer
    rows, repeated = arena.rows(torch.tensor([b, a, b]), torch.tensor([7, 9, 3]), insert=False)
    assert rows.tolist() == [1, -1, -1] and repeated == 0
    assert torch.equal(arena.gather(rows)[1:], torch.zeros(2, 2))  # never trained: zeros


def test_growth_keeps_every_row_and_its_slots():
    arena = EmbeddingArena(3, sparse.Adagrad(lr=0.1), capacity=16)
    var = arena.add("t", torch.randn(5, 3))
    first = torch.arange(10)
    rows, _ = arena.rows(torch.full((10,), var), first, insert=True)
    arena.apply(rows, torch.ones(10, 3), repeated=False)
    before = arena.gather(rows).clone(), arena.slots["accumulator"][rows].clone()
    more = torch.arange(10, 5000)  # many doublings and rehashes
    arena.rows(torch.full((more.numel(),), var), more, insert=True)
    again, _ = arena.rows(torch.full((10,), var), first, insert=False)
    assert torch.equal(again, rows)
    assert torch.equal(arena.gather(again), before[0]) and torch.equal(arena.slots["accumulator"][again], before[1])
    new_rows, _ = arena.rows(torch.full((3,), var), torch.tensor([10, 11, 4999]), insert=False)
    assert torch.equal(arena.slots["accumulator"][new_rows], torch.full((3, 3), 0.1))  # fresh slots at their init


def test_reserved_arena_grows_in_place_and_counts_only_rows_in_use():
    arena = EmbeddingArena(3, sparse.Adagrad(lr=0.1), reserve_bytes=64 << 20)
    assert arena.capacity == (64 << 20) // arena.bytes_per_row()  # address space, not memory
    var = arena.add("t", torch.randn(5, 3))
    weight, empty = arena.weight.data_ptr(), arena.memory()
    rows, _ = arena.rows(torch.full((20_000,), var), torch.arange(20_000), insert=True)
    assert arena.weight.data_ptr() == weight  # grown without a copy
    assert torch.equal(arena.gather(rows[:5]), arena._default_matrix[torch.arange(5)])
    # the rows in use are counted (and the index), not the reservation
    assert 20_000 * arena._row_bytes() < arena.memory() - empty < 20_000 * (arena._row_bytes() + 64)
    state = ShardState(0, 1, max_memory=1 << 30)
    state.register({"variables": [{"name": "e", "kind": "embedding", "dim": 8}]}, {})
    assert state.memory() < 1 << 20  # registering reserves, it does not commit


def test_arena_update_equals_the_row_sparse_optimizer_on_a_plain_table():
    torch.manual_seed(0)
    defaults = torch.randn(7, 4)
    arena = EmbeddingArena(4, sparse.Adam(lr=0.01))
    var = arena.add("t", defaults)
    table, slots, reference = defaults.clone(), sparse.Adam(lr=0.01).init_slots(7, 4), sparse.Adam(lr=0.01)
    for step in range(5):
        keys = torch.randperm(7)[:4]
        grad = torch.randn(4, 4)
        rows, repeated = arena.rows(torch.full((4,), var), keys, insert=True)
        arena.apply(rows, grad, bool(repeated))
        reference.begin_step()
        reference.update(table, slots, keys, grad)
    rows, _ = arena.rows(torch.zeros(7, dtype=torch.int64), torch.arange(7), insert=False)
    seen = rows >= 0
    assert torch.equal(arena.gather(rows)[seen], table[seen])  # the same ops: bit for bit


def test_a_request_over_two_arenas_of_one_dim_keeps_request_order():
    s = ShardState(0, 1)
    s.register({"variables": [{"name": "a", "kind": "embedding", "dim": 2, "optimizer": "sgd", "lr": 1.0},
                              {"name": "b", "kind": "embedding", "dim": 2, "optimizer": "sgd", "lr": 0.5},
                              {"name": "c", "kind": "embedding", "dim": 3, "optimizer": "sgd", "lr": 1.0}]},
               {"defaults/a": torch.zeros(1, 2), "defaults/b": torch.ones(1, 2), "defaults/c": torch.ones(1, 3)})
    assert len(s.arenas) == 3
    request = {"keys": torch.tensor([1, 2, 1, 5]), "counts": torch.tensor([1, 2, 1])}
    out = s.pull({"embeddings": ["b", "c", "a"]}, request)
    assert torch.equal(out["values/2"], torch.tensor([[1.0, 1.0], [0.0, 0.0]]))  # b's key 1, then a's key 5
    assert out["values/3"].shape == (2, 3)
    s.push({"embeddings": ["b", "c", "a"]}, {**request, "grads/2": torch.ones(2, 2), "grads/3": torch.ones(2, 3)})
    out = s.pull({"embeddings": ["b", "c", "a"], "train": False}, request)
    assert torch.equal(out["values/2"], torch.tensor([[0.5, 0.5], [-1.0, -1.0]]))  # each arena its own lr
    assert torch.equal(out["values/3"], torch.zeros(2, 3))


def test_export_and_load_round_trip_keeps_the_other_variables():
    def state():
        s = ShardState(0, 1)
        s.register({"variables": [{"name": n, "kind": "embedding", "dim": 2, "optimizer": "adagrad", "lr": 0.1}
                                  for n in ("a", "b")] + [{"name": "w", "kind": "dense", "optimizer": "adagrad"}]},
                   {"init/w": torch.ones(2, 2)})
        return s

    s = state()
    request = {"keys": torch.tensor([3, 4, 3]), "counts": torch.tensor([2, 1])}
    s.pull({"embeddings": ["a", "b"]}, request)
    s.push({"embeddings": ["a", "b"], "dense": ["w"]}, {**request, "grads/2": torch.ones(3, 2),
                                                        "dense/w": torch.ones(2, 2)})
    saved = s.export()
    restored = state()
    restored.pull({"embeddings": ["b"]}, {"keys": torch.tensor([9]), "counts": torch.tensor([1])})
    restored.load({k: v for k, v in saved.items() if not k.startswith("emb/b/")})  # only a and w
    again = restored.export()
    for key in ("emb/a/keys", "emb/a/values", "emb/a/slot.accumulator", "dense/w", "dense_slot/w/accumulator"):
        assert torch.equal(again[key], saved[key]), key
    assert again["emb/b/keys"].tolist() == [9]  # b kept its own rows
    assert int(again["opt/a"]) == 1 and int(again["opt/w"]) == 1


def test_dense_group_one_step_for_all_and_only_the_pushed_slices():
    shapes = {"w": (3, 2), "b": (3,), "v": (4,)}
    group, reference = DenseGroup(sparse.Adagrad(lr=0.1)), {}
    for name, shape in shapes.items():
        group.add(name, torch.ones(shape))
    grads = {name: torch.randn(shape) for name, shape in shapes.items()}
    group.apply(grads)
    for name, shape in shapes.items():
        opt = sparse.Adagrad(lr=0.1)
        value, slots = torch.ones(1, *shape).reshape(1, -1), opt.init_slots(1, int(torch.tensor(shape).prod()))
        opt.begin_step()
        opt.update(value, slots, torch.zeros(1, dtype=torch.int64), grads[name].reshape(1, -1))
        reference[name] = value.reshape(shape)
        assert torch.equal(group.view(name), reference[name]), name
    group.apply({"b": torch.ones(3)})
    assert torch.equal(group.view("w"), reference["w"]) and not torch.equal(group.view("b"), reference["b"])
    assert group.optimizer.step_count == 2


def test_a_load_refuses_a_key_held_twice():
    arena = EmbeddingArena(2, sparse.SGD(lr=1.0))
    var = arena.add("t", torch.zeros(1, 2))
    state = {"keys": torch.tensor([5, 5]), "values": torch.zeros(2, 2), "freq": torch.zeros(2, dtype=torch.int64),
             "version": torch.zeros(2, dtype=torch.int64)}
    with pytest.raises(ValueError, match="1 keys twice"):
        arena.load({var: state}, shard_index=0, num_shards=1)


def test_received_tensors_are_aligned_views_of_the_message():
    import numpy as np

    from deeprec.distributed.ps.wire import pack, unpack

    for pad in range(12):  # every header length modulo 8
        message = pack({"note": "x" * pad}, {"keys": torch.arange(5), "grads": torch.ones(3, 4),
                                             "flag": torch.tensor([True])})
        start = np.frombuffer(message, np.uint8).ctypes.data
        header, tensors = unpack(message)
        assert header["note"] == "x" * pad
        for name, t in tensors.items():
            assert start <= t.data_ptr() < start + len(message), name  # a view, not a copy
            assert t.data_ptr() % 8 == 0, name
        assert torch.equal(tensors["keys"], torch.arange(5)) and torch.equal(tensors["grads"], torch.ones(3, 4))
