"""EmbeddingCollection (fused lookup) and EmbeddingVariable."""
import copy
from typing import Sequence
import threading

import pytest
import torch

from deeprec import optim
from deeprec.errors import ConfigError
from deeprec.nn.lookup import COMBINERS
from deeprec.nn import (CBFFilter, CounterFilter, EmbeddingCollection, EmbeddingFeature, EmbeddingVariable,
                        EmbeddingVariableOption, GlobalStepEvict, InitializerOption, L2WeightEvict, Ragged, prepare_bags, shard_of)


def reference_pool(table, ids, combiner, fill_id=None, max_norm=None):
    """The unfused formula, bag by bag, differentiable by autograd."""
    out = []
    for bag in ids:
        bag = [i for i in bag if i >= 0]
        if not bag and fill_id is not None:
            bag = [fill_id]
        if not bag:
            out.append(torch.zeros(table.shape[1]))
            continue
        rows = table[torch.tensor(bag)]
        if max_norm is not None:
            rows = rows * (max_norm / rows.norm(dim=1, keepdim=True).clamp_min(1e-12)).clamp(max=1.0)
        total = rows.sum(0)
        n = len(bag)
        out.append(total if combiner == "sum" else total / n if combiner == "mean" else total / n ** 0.5)
    return torch.stack(out)


BAGS = torch.tensor([[3, 3, 1], [-1, -1, -1], [0, -1, 2], [4, 1, -5]])


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("fill_id", [None, 2])
@pytest.mark.parametrize("max_norm", [None, 0.05])
def test_combiners_forward_and_backward_match_the_unfused_formula(combiner, fill_id, max_norm):
    torch.manual_seed(0)
    coll = EmbeddingCollection([EmbeddingFeature("a", 6, combiner=combiner, fill_id=fill_id),
                                EmbeddingFeature("b", 5, combiner="sum")], 4, max_norm=max_norm, init_bound=0.1)
    coll.set_optimizer(optim.SGD(lr=1.0))  # w_new = w - grad: the update reveals the gradient
    w0 = coll.lookup.weight.detach().clone()
    b_ids = torch.tensor([1, 4, 4, 0])
    upstream = torch.randn(4, 2, 4)
    out = coll({"a": BAGS, "b": b_ids})
    (out * upstream).sum().backward()

    table = w0.clone().requires_grad_(True)
    ref_a = reference_pool(table[:6], BAGS.tolist(), combiner, fill_id, max_norm)
    ref_b = reference_pool(table[6:], b_ids.unsqueeze(1).tolist(), "sum", None, max_norm)
    ref = torch.stack([ref_a, ref_b], dim=1)
    assert torch.allclose(out.detach(), ref.detach(), atol=1e-6)
    (ref * upstream).sum().backward()
    assert torch.allclose(w0 - coll.lookup.weight.detach(), table.grad, atol=1e-6)


def test_ragged_input_equals_padded():
    coll = EmbeddingCollection([EmbeddingFeature("a", 6, combiner="mean")], 3)
    padded = coll({"a": torch.tensor([[1, 2, -1], [5, -1, -1]])})
    ragged = coll({"a": Ragged(torch.tensor([1, 2, 5]), torch.tensor([0, 2, 3]))})
    assert torch.equal(padded, ragged)


def test_out_of_range_id_names_the_feature():
    coll = EmbeddingCollection([EmbeddingFeature("C7", 6)], 3)
    with pytest.raises(IndexError, match="feature 'C7': id 9 is out of range"):
        coll({"C7": torch.tensor([1, 9])})
    with pytest.raises(ConfigError, match="combiner='max' is not allowed"):
        EmbeddingFeature("x", 3, combiner="max")


def test_unfused_steps_merge_micro_batches_into_the_full_batch_update():
    torch.manual_seed(0)
    ids = torch.randint(0, 8, (16, 2))
    full = EmbeddingCollection([EmbeddingFeature("a", 8, combiner="sum")], 4).set_optimizer(optim.Adagrad(lr=0.1))
    micro = EmbeddingCollection([EmbeddingFeature("a", 8, combiner="sum")], 4)
    micro.set_optimizer(optim.Adagrad(lr=0.1), fused=False)  # slots exist before a restore
    micro.load_state_dict(full.state_dict())
    full({"a": ids}).pow(2).sum().backward()
    for part in ids.split(4):  # same rows appear in several micro-batches: merged before one update
        micro({"a": part}).pow(2).sum().backward()
    micro.apply_pending()
    assert torch.allclose(full.lookup.weight, micro.lookup.weight, atol=1e-6)


def test_without_row_sparse_optimizer_the_gradient_is_left_sparse_for_torch_optim():
    coll = EmbeddingCollection([EmbeddingFeature("a", 4)], 2)
    coll({"a": torch.tensor([1, 1, 3])}).sum().backward()
    grad = coll.lookup.weight.grad
    assert grad.is_sparse and grad.to_dense().tolist() == [[0, 0], [2, 2], [0, 0], [1, 1]]
    variables = EmbeddingCollection([EmbeddingFeature("a")], 2)
    with pytest.raises(RuntimeError, match="needs a row-sparse optimizer"):
        variables({"a": torch.tensor([1])}).sum().backward()


# -- EmbeddingVariable ------------------------------------------------------------------------------
def test_unbounded_keys_without_collisions_and_reproducible_init():
    ev = EmbeddingVariable(8, ev_option=EmbeddingVariableOption(InitializerOption(default_value_dim=97, seed=3)))
    keys = torch.unique(torch.randint(-2**62, 2**62, (50_000,)))
    rows = ev.rows_for(keys)
    assert ev.size == keys.numel() and torch.equal(torch.sort(rows).values, torch.arange(keys.numel()))
    assert torch.equal(ev.rows_for(keys[::7]), rows[::7]) and ev.size == keys.numel()
    defaults = InitializerOption(default_value_dim=97, seed=3).matrix(8)
    assert torch.equal(ev.gather(rows[:100]), defaults[torch.remainder(keys[:100], 97)])
    assert ev.bytes_per_row() < 200


def test_frequency_counts_every_occurrence():
    coll = EmbeddingCollection([EmbeddingFeature("a", ev_option=EmbeddingVariableOption(
        filter_option=CounterFilter(filter_freq=3)))], 2).set_optimizer(optim.SGD(lr=0.1))
    coll({"a": torch.tensor([[9, 9], [9, 4]])})  # key 9 seen 3 times in one batch: admitted
    ev = coll.lookup.variables[0]
    assert ev.size == 1 and ev.freq[0] == 3 and int(ev.keys[0]) == 9


def test_eval_mode_does_not_insert():
    ev = EmbeddingVariable(2, ev_option=EmbeddingVariableOption(InitializerOption(default_value_no_permission=0.5)))
    rows = ev.rows_for(torch.tensor([5, 6]), train=False)
    assert rows.tolist() == [-1, -1] and ev.size == 0
    assert (ev.gather(rows) == 0.5).all()


@pytest.mark.parametrize("filter_option", [CounterFilter(filter_freq=3),
                                           CBFFilter(filter_freq=3, max_element_size=1000,
                                                     false_positive_probability=0.001)])
def test_filters_admit_after_filter_freq_sightings(filter_option):
    opt = EmbeddingVariableOption(InitializerOption(default_value_no_permission=-1.0), filter_option=filter_option)
    coll = EmbeddingCollection([EmbeddingFeature("a", ev_option=opt)], 2).set_optimizer(optim.SGD(lr=1.0))
    ev = coll.lookup.variables[0]
    for sighting in (1, 2):
        out = coll({"a": torch.tensor([42])})
        assert out.tolist() == [[[-1.0, -1.0]]] and ev.size == 0  # not admitted: default value
        out.sum().backward()  # and no update
    out = coll({"a": torch.tensor([42])})  # third sighting: admitted
    assert ev.size == 1 and out.tolist() != [[[-1.0, -1.0]]]
    before = ev.weight[0].clone()
    out.sum().backward()
    assert torch.equal(ev.weight[0], before - 1.0)


def test_deepcopy_keeps_rows_and_admission_state():
    opt = EmbeddingVariableOption(filter_option=CounterFilter(filter_freq=2))
    ev = EmbeddingVariable(4, ev_option=opt)
    ev.rows_for(torch.tensor([1, 2, 3]))  # first sightings: pending
    ev.rows_for(torch.tensor([1]))  # admitted
    twin = copy.deepcopy(ev)
    assert twin.size == 1 and torch.equal(twin.weight[:1], ev.weight[:1])
    for model in (ev, twin):  # the copy has its own index and pending counts, in the same state
        assert model.rows_for(torch.tensor([1, 2, 4])).tolist() == [0, 1, -1]
    assert twin.rows_for(torch.tensor([5])).tolist() == [-1] and ev.size == twin.size == 2


def test_evictions_apply_at_save():
    gs = EmbeddingVariable(2, ev_option=EmbeddingVariableOption(evict_option=GlobalStepEvict(steps_to_live=5)))
    gs.rows_for(torch.tensor([1, 2, 3]))
    gs.global_step = 10
    gs.apply_update(optim.SGD(lr=0.1), torch.tensor([1]), torch.ones(1, 2))  # only key 2's row is fresh
    state = gs.export()
    assert state["keys"].tolist() == [2] and gs.size == 1
    l2 = EmbeddingVariable(2, ev_option=EmbeddingVariableOption(evict_option=L2WeightEvict(0.5)))
    rows = l2.rows_for(torch.tensor([7, 8]))
    l2.weight[rows[0]] = torch.tensor([1.0, 1.0])  # 0.5 * 2 = 1.0 >= 0.5: kept
    l2.weight[rows[1]] = torch.tensor([0.1, 0.1])
    assert l2.export()["keys"].tolist() == [7]


def _ev_model(seed=0, **ev_kw):
    torch.manual_seed(seed)
    return EmbeddingCollection([EmbeddingFeature("a", ev_option=EmbeddingVariableOption(**ev_kw)),
                                EmbeddingFeature("b", combiner="mean")], 4).set_optimizer(optim.Adam(lr=0.05))


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"a": torch.randint(0, 10**12, (32,), generator=g) % 5000,
             "b": torch.randint(0, 50, (32, 3), generator=g)} for _ in range(n)]


def _train(model, batches):
    for b in batches:
        model(b).pow(2).sum().backward()


def test_checkpoint_restores_and_continues_identically(tmp_path):
    batches = _batches(30)
    a = _ev_model()
    _train(a, batches[:10])
    path = tmp_path / "ev.pt"
    torch.save(a.state_dict(), path)
    b = _ev_model(seed=5)
    b.load_state_dict(torch.load(path, weights_only=True))
    _train(a, batches[10:])
    _train(b, batches[10:])
    for ev_a, ev_b in zip(a.lookup.variables, b.lookup.variables):
        sa, sb = ev_a.export(), ev_b.export()
        order_a, order_b = torch.argsort(sa["keys"]), torch.argsort(sb["keys"])
        for key in ("keys", "values", "slot.exp_avg", "slot.exp_avg_sq", "freq", "version"):
            assert torch.equal(sa[key][order_a], sb[key][order_b]), key


def test_restore_onto_a_different_shard_count():
    ev = EmbeddingVariable(3)
    keys = torch.arange(0, 200_000, 7)
    ev.rows_for(keys)
    state = ev.export()
    shards = [EmbeddingVariable(3, shard_index=i, num_shards=3) for i in range(3)]
    for shard in shards:
        shard.load(state)
    got = torch.cat([s.export()["keys"] for s in shards])
    assert torch.equal(torch.sort(got).values, keys)
    for i, shard in enumerate(shards):
        own = shard.export()
        assert (shard_of(own["keys"], 3) == i).all()
        rows = ev.rows_for(own["keys"], train=False)
        assert torch.equal(own["values"], ev.weight[rows])
    # training continues identically: each key's update goes to the shard that owns it
    opt_one, opt_sharded = optim.Adagrad(lr=0.1), optim.Adagrad(lr=0.1)
    ev.attach_slots({"accumulator": (0.1, True)})
    for shard in shards:
        shard.attach_slots({"accumulator": (0.1, True)})
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        keys_step = torch.unique(keys[torch.randint(0, keys.numel(), (500,), generator=g)])
        grad = torch.randn(keys_step.numel(), 3, generator=g)
        ev.apply_update(opt_one, ev.rows_for(keys_step, train=False), grad)
        for i, shard in enumerate(shards):
            mine = shard_of(keys_step, 3) == i
            shard.apply_update(opt_sharded, shard.rows_for(keys_step[mine], train=False), grad[mine])
    for shard in shards:
        own = shard.export()
        assert torch.equal(own["values"], ev.weight[ev.rows_for(own["keys"], train=False)])


def test_incremental_checkpoint_holds_only_touched_rows():
    ev = EmbeddingVariable(2)
    ev.rows_for(torch.arange(100))
    full = ev.export()
    ev.apply_update(optim.SGD(lr=1.0), torch.tensor([3, 50]), torch.ones(2, 2))
    ev.rows_for(torch.tensor([1000]))  # a new key is touched too
    inc = ev.export(incremental=True)
    assert sorted(inc["keys"].tolist()) == [3, 50, 1000]
    restored = EmbeddingVariable(2)
    restored.load(full)
    restored.load(inc)
    for key in (3, 50, 1000, 7):
        r1, r2 = ev.rows_for(torch.tensor([key]), train=False), restored.rows_for(torch.tensor([key]), train=False)
        assert torch.equal(ev.weight[r1], restored.weight[r2])


def test_save_during_inserts_snapshots_rows_with_their_slots():
    # DeepRec issue 1023: keys inserted mid-save came back with garbage Adam slots
    coll = EmbeddingCollection([EmbeddingFeature("a")], 4).set_optimizer(optim.Adam(lr=0.1))
    ev = coll.lookup.variables[0]
    stop = threading.Event()

    def insert_forever():
        k = 0
        while not stop.is_set():
            ev.rows_for(torch.arange(k, k + 500))
            k += 500

    thread = threading.Thread(target=insert_forever)
    thread.start()
    try:
        for _ in range(20):
            state = ev.export()
            n = state["keys"].numel()
            assert state["values"].shape[0] == state["slot.exp_avg"].shape[0] == n
            assert (state["slot.exp_avg"] == 0).all() and (state["slot.exp_avg_sq"] == 0).all()
            assert torch.isfinite(state["values"]).all()
    finally:
        stop.set()
        thread.join()


def test_flush_denormal_is_available():
    assert torch.set_flush_denormal(True)
    try:
        assert (torch.tensor([1e-39]) * 1.0).item() == 0.0
    finally:
        torch.set_flush_denormal(False)


# The torch-op composition that the native prepare_bags replaced (deeprec <= 0.1), kept as its reference.
def _as_bags(ids) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat values, lengths) of [B] ids, [B, L] padded ids, or a Ragged."""
    if (isinstance(ids, tuple) and len(ids) == 2):
        values, offsets = ids
        return values.reshape(-1).long(), (offsets[1:] - offsets[:-1]).long()
    ids = torch.as_tensor(ids)
    if ids.dim() == 1:
        ids = ids.unsqueeze(1)
    if ids.dim() != 2:
        raise ValueError(f"ids must be [B], [B, L] or Ragged(values, offsets), got shape {tuple(ids.shape)}")
    return ids.reshape(-1).long(), torch.full((ids.shape[0],), ids.shape[1], dtype=torch.long)


def reference_prepare_bags(ids: Sequence, combiners: Sequence[str], fill_ids: Sequence):
    """Prune negative ids, fill empty bags, dedup per feature, and lay out all
    F x B bags (feature-major) for one bag reduction.

    Returns (unique keys per feature, global inverse, offsets [F*B + 1], per-sample weights,
    occurrences of each unique key per feature).
    """
    uniques, inverses, lengths_all, weights, counts = [], [], [], [], []
    base = 0
    batch = None
    for f, (feature_ids, combiner, fill) in enumerate(zip(ids, combiners, fill_ids)):
        values, lengths = _as_bags(feature_ids)
        if batch is None:
            batch = lengths.numel()
        elif lengths.numel() != batch:
            raise ValueError(f"feature {f} has {lengths.numel()} rows, feature 0 has {batch}")
        bag_of = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        keep = values >= 0  # prune invalid ids
        values, bag_of = values[keep], bag_of[keep]
        lengths = torch.bincount(bag_of, minlength=lengths.numel())
        if fill is not None:  # an empty bag looks up the default id instead of yielding zeros
            empty = torch.nonzero(lengths == 0).squeeze(1)
            if empty.numel():
                values = torch.cat([values, torch.full((empty.numel(),), int(fill), dtype=values.dtype)])
                bag_of = torch.cat([bag_of, empty])
                order = torch.argsort(bag_of, stable=True)
                values, bag_of = values[order], bag_of[order]
                lengths = torch.bincount(bag_of, minlength=lengths.numel())
        unique, inverse, count = torch.unique(values, return_inverse=True, return_counts=True)
        uniques.append(unique)
        counts.append(count)
        inverses.append(inverse + base)
        base += unique.numel()
        lengths_all.append(lengths)
        n = lengths.clamp_min(1).to(torch.float32)[bag_of]
        if combiner == "sum":
            weights.append(torch.ones_like(n))
        elif combiner == "mean":
            weights.append(1.0 / n)
        elif combiner == "sqrtn":
            weights.append(n.rsqrt())
        else:
            raise ValueError(f"combiner={combiner!r} is not allowed; choose one of {COMBINERS}")
    lengths = torch.cat(lengths_all)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return tuple(uniques), torch.cat(inverses), offsets, torch.cat(weights), tuple(counts)




def test_native_prepare_bags_sorts_many_keys_as_the_torch_composition():
    # past 64 distinct keys a feature's uniques are radix sorted: 63-bit hashed keys (all 8 bytes
    # differ), a narrow range (one byte pass), keys sharing high bytes, duplicates, pruned ids
    g = torch.Generator().manual_seed(3)
    batch = 700
    features = [torch.randint(0, 1 << 62, (batch,), generator=g) * 2 + torch.randint(0, 2, (batch,), generator=g),
                torch.randint(-5, 300, (batch,), generator=g), (1 << 40) + torch.randint(0, 1 << 20, (batch, 2), generator=g),
                torch.randint(0, 1 << 62, (batch,), generator=g)[torch.randint(0, 80, (batch,), generator=g)]]
    combiners, fills = ["sum", "mean", "sqrtn", "sum"], [None, 4, None, None]
    got, want = prepare_bags(features, combiners, fills), reference_prepare_bags(features, combiners, fills)
    assert all(u.numel() > 64 for u in got[0])
    for a, b in zip(got, want):
        if isinstance(a, tuple):
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
        else:
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_native_prepare_bags_equals_the_torch_composition(seed):
    g = torch.Generator().manual_seed(seed)
    batch = 37
    lengths = torch.randint(0, 4, (batch,), generator=g)
    ragged = Ragged(torch.randint(-3, 20, (int(lengths.sum()),), generator=g), torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))
    features = [torch.randint(-2, 50, (batch,), generator=g), torch.randint(0, 9, (batch, 3), generator=g), ragged, ragged,
                torch.full((batch,), -1)]
    combiners = ["sum", "mean", "sqrtn", "mean", "sum"]
    fills = [None, 0, 7, None, 3]
    got = prepare_bags(features, combiners, fills)
    want = reference_prepare_bags(features, combiners, fills)
    for a, b in zip(got, want):
        if isinstance(a, tuple):
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
        else:
            assert a.dtype == b.dtype and torch.equal(a, b)
    with pytest.raises(ValueError, match="feature 1 has 3 rows, feature 0 has 37"):
        prepare_bags([features[0], torch.zeros(3, dtype=torch.long)], ["sum", "sum"], [None, None])
    with pytest.raises(ValueError, match="combiner='max' is not allowed"):
        prepare_bags(features[:1], ["max"], [None])


@pytest.mark.parametrize("embedding", ["table", "variable"])
def test_row_sparse_optimizer_counts_one_step_per_training_step(sample, embedding):
    """A collection of EmbeddingVariables hands one gradient per feature to the backward: the
    optimizer step (Adam's bias correction, GlobalStepEvict's clock) must still advance once."""
    import itertools

    from deeprec.data import CriteoReader
    from deeprec.models import build_model

    model = build_model("dlrm", embedding=embedding, hash_buckets=1000)
    opt = optim.make_optimizer(model, "adam", 0.01)
    for batch in itertools.islice(CriteoReader(sample, 32), 3):
        model(batch)["loss"].backward()
        opt.step()
        opt.zero_grad()
    assert model.embeddings.collection.lookup.optimizer.step_count == 3
    if embedding == "variable":
        assert all(ev.global_step == 3 for ev in model.embeddings.collection.lookup.variables)


def test_embedding_variable_as_a_layer_with_duplicate_ids():
    """ev(ids) like nn.Embedding: any id shape, autograd, one summed update per row."""
    torch.manual_seed(0)
    ev = EmbeddingVariable(4, name="item")
    model = torch.nn.ModuleDict({"ev": ev, "head": torch.nn.Linear(4, 1)})
    opt = optim.make_optimizer(model, "sgd", lr=0.5)  # the free EmbeddingVariable gets a row-sparse SGD
    assert isinstance(ev.optimizer, optim.SGD)
    ids = torch.tensor([[3, 3], [7, -5]])
    out = ev(ids)
    assert out.shape == (2, 2, 4)
    before = {k: out[i, j].detach().clone() for (i, j), k in (((0, 0), 3), ((1, 0), 7), ((1, 1), -5))}
    out.sum().backward()  # d/d row = one per occurrence: key 3 occurs twice
    opt.step()
    ev.eval()
    after = ev(torch.tensor([3, 7, -5]))
    assert torch.allclose(after[0], before[3] - 0.5 * 2)  # gradients of a duplicate summed, one update
    assert torch.allclose(after[1], before[7] - 0.5 * 1) and torch.allclose(after[2], before[-5] - 0.5)
    assert ev.optimizer.step_count == 1 and ev.global_step == 1
    unknown = ev(torch.tensor([123456]))  # eval: an unseen key reads the default, inserts nothing
    assert unknown.shape == (1, 4) and len(ev.export()["keys"]) == 3
    # its optimizer's step count travels with the model's state_dict (Adam's bias correction resumes exactly)
    twin = torch.nn.ModuleDict({"ev": EmbeddingVariable(4, name="item"), "head": torch.nn.Linear(4, 1)})
    optim.make_optimizer(twin, "sgd", lr=0.5)
    twin.load_state_dict(model.state_dict())
    assert twin["ev"].optimizer.step_count == 1
    assert torch.equal(twin["ev"](torch.tensor([3, 7])), ev(torch.tensor([3, 7])))


def test_embedding_variable_gradient_without_optimizer_is_a_clear_error():
    ev = EmbeddingVariable(2, name="user")
    with pytest.raises(RuntimeError, match="'user' got a gradient but has no row-sparse optimizer"):
        ev(torch.tensor([1, 2])).sum().backward()
