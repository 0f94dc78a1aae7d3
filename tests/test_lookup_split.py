"""deeprec/graph/lookup_split.py: the step split at its lookups, which graph_fusion (`--compile`)
compiles segment by segment: the split graph computes bitwise what the graph did, and compiled, each
dense segment is traced once, however the EmbeddingVariables grow."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import deeprec as dr
from custom_models import DIM, _click, _dense
from deeprec.cli import sample_path
from deeprec.data import open_reader, resolve_schema
from deeprec.graph import capture
from deeprec.graph.lookup_split import dense_segments, split_at_lookups
from deeprec.nn import EmbeddingLookup
from deeprec.optim import make_optimizer


class Interleaved(nn.Module):
    """Lookups between dense layers: a user tower on one variable's rows before the second lookup."""

    def __init__(self):
        super().__init__()
        self.user, self.item = dr.EmbeddingVariable(DIM, name="user"), dr.EmbeddingVariable(DIM, name="item")
        self.user_tower = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU())
        self.head = nn.Linear(2 * DIM + 3, 1)

    def forward(self, batch):
        user_keys, item_keys = dr.ops.string_to_hash_key([batch["C1"], batch["C2"]])
        user = self.user_tower(self.user(user_keys))
        item = self.item(item_keys)
        return _click(self.head(torch.cat([user, item, _dense(batch)], 1)).squeeze(1), batch)


@pytest.fixture(scope="module")
def batches():
    reader = iter(open_reader([sample_path()], 32, schema=resolve_schema([sample_path()], None)))
    return [next(reader) for _ in range(4)]


def _segments(split) -> list[str]:
    return [n.target for n in split.graph.nodes if n.op == "call_module"]


def test_each_run_of_lookups_is_a_segment_between_dense_segments_in_node_order():
    split = split_at_lookups(capture(Interleaved()))
    assert _segments(split) == ["dense_0", "lookup_1", "dense_2", "lookup_3", "dense_4"]
    for name, segment in split.named_children():
        inner = [m for m in segment.modules() if m is not segment]
        lookups = [m for m in inner if isinstance(m, EmbeddingLookup)]
        assert bool(lookups) == name.startswith("lookup_"), name
    assert set(dense_segments(split)) == {"dense_0", "dense_2", "dense_4"}
    # the segments hold the model's own parameters: nothing copied
    model_params = {id(p) for p in split.parameters()}
    assert {id(p) for p in split.dense_2.parameters()} <= model_params and list(split.dense_2.parameters())


class OwnDenseNames(nn.Module):
    """Modules of the model's own named like the pass's segments, read as parameters (get_attr: they
    stay on the parent graph beside the segments)."""

    def __init__(self):
        super().__init__()
        self.item = dr.EmbeddingVariable(DIM, name="item")
        self.dense_2, self.dense_proj = nn.Linear(3, DIM), nn.Linear(DIM, 1)

    def forward(self, batch):
        rows = self.item(dr.ops.string_to_hash_key(batch["C1"]))
        x = _dense(batch) @ self.dense_2.weight.t() + rows
        return _click((x @ self.dense_proj.weight.t()).squeeze(1), batch)


def test_the_models_own_dense_names_are_kept_apart_from_the_segments(batches):
    torch.manual_seed(0)
    model = OwnDenseNames()
    split = split_at_lookups(capture(copy.deepcopy(model)))
    assert _segments(split) == ["dense_0", "lookup_1", "_dense_2"]  # renamed: the model has a dense_2
    assert set(dense_segments(split)) == {"dense_0", "_dense_2"}  # not the model's dense_2, dense_proj
    assert torch.equal(split(batches[0])["logits"], capture(model)(batches[0])["logits"])


def test_the_split_graph_computes_bitwise_what_the_graph_did(batches):
    torch.manual_seed(0)
    plain = Interleaved()
    twin = copy.deepcopy(plain)
    graph, split = capture(plain), split_at_lookups(capture(twin))
    opt_plain, opt_twin = make_optimizer(plain, "adagrad", 0.05), make_optimizer(twin, "adagrad", 0.05)
    for batch in batches:  # new keys each batch: the variables grow between the steps
        a, b = graph(batch), split(batch)
        assert torch.equal(a["loss"], b["loss"]) and torch.equal(a["logits"], b["logits"])
        a["loss"].backward()
        b["loss"].backward()
        for (name, p), q in zip(plain.named_parameters(), twin.parameters()):
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad), name
        for opt in (opt_plain, opt_twin):
            opt.step()
            opt.zero_grad()
        for (name, p), q in zip(plain.state_dict().items(), twin.state_dict().values()):
            assert torch.equal(p, q), name


@pytest.mark.slow(reason="inductor compiles two small graphs, forward and backward (20-70 s on 2 cores)")
def test_compiled_step_traces_each_dense_segment_once_while_variables_grow(batches):
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    model = Interleaved()
    opt = make_optimizer(model, "adagrad", 0.05)
    fast = dr.optimize(model, dr.Config(smart_stage=True, graph_fusion=True))
    sizes = []
    for batch in batches * 2:
        fast(batch)["loss"].backward()
        opt.step()
        opt.zero_grad()
        sizes.append(model.user.size)
    assert sizes[0] < sizes[3]  # the variables grew: before the split, every growth recompiled
    compiled = fast.main_step.compiled
    assert compiled.failed is None and compiled.segments == 2  # the hashing is staged: two dense segments
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == compiled.segments
