"""The SmartStage pass and deeprec.optimize: partition rules, markers, equality."""
import copy
import threading

import numpy as np
import pytest
import torch
from torch import nn

import deeprec as dr
from deeprec import ops
from deeprec.data import CriteoReader
from deeprec.graph import CaptureError, capture, smart_stage_pass
from deeprec.models import build_model
from deeprec.optim import make_optimizer

SMART = dr.Config(smart_stage=True, smart_stage_options=dr.SmartStageOptions(capacity=3, num_threads=2),
                  main_threads=torch.get_num_threads())  # same intra-op threads: bit-identical math


@pytest.mark.parametrize("name,embedding", [("dlrm", "table"), ("deepfm", "table"), ("wdl", "table"),
                                            ("dlrm", "variable")])
def test_training_identical_with_and_without_smart_stage(name, embedding, sample):
    """EmbeddingVariables too: their lookup inserts keys, so it must stay in the step
    (staged ahead, it would read rows before the previous step's update)."""
    torch.manual_seed(0)
    plain = build_model(name, hash_buckets=500, embedding=embedding)
    staged_model = copy.deepcopy(plain)
    fast = dr.optimize(staged_model, SMART)
    assert fast.staged
    opt_a, opt_b = make_optimizer(plain, "adam", 1e-2), make_optimizer(staged_model, "adam", 1e-2)
    reader_kw = dict(batch_size=32, shuffle_buffer=64, seed=1, num_epochs=2)
    plain_losses, staged_losses = [], []
    for batch in CriteoReader(sample, **reader_kw):
        out = plain(batch)
        out["loss"].backward()
        plain_losses.append(out["loss"].item())
        opt_a.step()
        opt_a.zero_grad()
    for out in fast.iterate(CriteoReader(sample, **reader_kw)):
        out["loss"].backward()
        staged_losses.append(out["loss"].item())
        opt_b.step()
        opt_b.zero_grad()
    assert len(plain_losses) == 14 and plain_losses == staged_losses
    for (k, a), b in zip(plain.state_dict().items(), staged_model.state_dict().values(), strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, k
    if embedding == "variable":
        assert "embeddings_collection_lookup" in fast.partition.kept


def test_first_step_outputs_and_gradients_identical(sample):
    torch.manual_seed(0)
    model = build_model("dlrm", hash_buckets=500, embedding="table")
    batch = next(iter(CriteoReader(sample, 64)))
    ref = model(batch)
    ref["loss"].backward()
    ref_grads = {k: p.grad.to_dense().clone() for k, p in model.named_parameters()}
    model.zero_grad()
    fast = dr.optimize(model, SMART)
    out = fast(batch)
    assert torch.equal(out["logits"], ref["logits"]) and torch.equal(out["loss"], ref["loss"])
    out["loss"].backward()
    for k, p in model.named_parameters():
        assert torch.equal(p.grad.to_dense(), ref_grads[k]), k


def test_parameters_stay_the_users():
    model = build_model("dlrm", hash_buckets=100, embedding="table")
    fast = dr.optimize(model, SMART)
    ids = {id(p) for p in model.parameters()}
    assert {id(p) for p in fast.partition.main.parameters()} <= ids
    assert not list(fast.partition.stage.parameters())


def test_plain_graph_is_untouched():
    gm = capture(build_model("dlrm", hash_buckets=100))
    before = gm.code
    smart_stage_pass(gm)
    assert gm.code == before


class Rules(nn.Module):
    """One data-side node for each reason a node stays in main."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.register_buffer("shift", torch.zeros(1))

    def forward(self, batch):
        x = ops.fill_missing(batch["I1"])                 # staged
        ids = ops.string_to_hash_bucket(batch["C1"], 10)  # staged
        y = x * self.scale                                # parameter
        z = x + self.shift                                # buffer
        n = torch.randn_like(x)                           # random op
        t = dr.mark_target_node(ids.float())              # target-marked
        c = counted(x)                                    # stateful op
        return {"loss": (y + z + n + t + c + torch.log1p(x)).sum()}


@ops.op(stateful=True)
def counted(x):
    return x * 1.0


def _batch():
    return {"I1": torch.tensor([1.0, float("nan")]), "C1": dr.Ragged.from_strings([b"a", b"b"])}


def test_region_and_reasons():
    part = smart_stage_pass(capture(Rules()))
    assert {"fill_missing", "string_to_hash_bucket", "log1p"} <= set(part.stage_nodes)
    assert part.kept["mul"] == "depends on parameter/buffer scale"
    assert part.kept["add"] == "depends on parameter/buffer shift"
    assert part.kept["randn_like"].startswith("random op randn_like")
    assert part.kept["mark_target_node"] == "target-marked (mark_target_node)"
    assert part.kept["counted"] == "stateful op counted"
    assert "float_1" in part.stage_nodes  # upstream of the marked node: still data side
    assert set(part.cut) == {"fill_missing", "float_1", "log1p"}
    torch.manual_seed(3)
    ref = Rules()(_batch())["loss"]
    torch.manual_seed(3)
    assert torch.equal(dr.optimize(Rules(), dr.Config(smart_stage=True))(_batch())["loss"], ref)


class ManualStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(10, 3)

    def forward(self, batch):
        dense, col = dr.staged(batch["I1"], batch["C1"])
        ids = ops.string_to_hash_bucket(col, 10)
        return {"loss": (self.table(ids).sum(1) + ops.log_normalize(dense)).sum()}


def test_staged_marker_alone_stages_only_its_inputs():
    fast = dr.optimize(ManualStage(), dr.Config(smart_stage=False))
    assert fast.partition.manual and set(fast.partition.stage_nodes) == {"getitem", "getitem_1", "staged"}
    smart = dr.optimize(ManualStage(), dr.Config(smart_stage=True))
    assert {"string_to_hash_bucket", "log_normalize"} <= set(smart.partition.stage_nodes)  # extended
    model = ManualStage()
    b = _batch() | {"I1": torch.tensor([1.0, 2.0])}
    assert torch.equal(dr.optimize(model, dr.Config(smart_stage=True))(b)["loss"], model(b)["loss"])


def test_staged_marker_on_parameter_is_an_error():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, batch):
            return dr.staged(batch["I1"] * self.w).sum()

    with pytest.raises(dr.ConfigError, match="depends on .*parameter/buffer w.*stale"):
        dr.optimize(Bad())


def test_untraceable_model_names_the_line_and_suggests_op():
    class Branchy(nn.Module):
        def forward(self, batch):
            if batch["I1"].sum() > 0:  # data-dependent control flow
                return batch["I1"]
            return -batch["I1"]

    with pytest.raises(CaptureError) as err:
        dr.optimize(Branchy(), dr.Config(smart_stage=True))
    message = str(err.value)
    assert "test_smart_stage.py:" in message and 'if batch["I1"].sum() > 0' in message
    assert "@deeprec.op" in message


def test_async_embedding_needs_smart_stage():
    with pytest.raises(dr.ConfigError, match="needs smart_stage=True"):
        dr.Config(async_embedding=True)
    from deeprec.distributed.ps.worker import RemoteLookup

    model = build_model("dlrm", embedding="variable")
    local = model.embeddings.collection.lookup
    assert dr.optimize(model, dr.Config(smart_stage=True, async_embedding=True)).async_lookups == []  # nothing remote
    model.embeddings.collection.lookup = RemoteLookup(None, [f.name for f in local.features], local)  # as PSUpdater
    fast = dr.optimize(model, dr.Config(smart_stage=True, async_embedding=True))
    (lookup, index), = fast.async_lookups  # the lookup's keys come out of the stage
    keys = next(n for n in fast.graph_module.graph.nodes if n.name == fast.partition.cut[index])
    assert lookup is model.embeddings.collection.lookup
    assert keys.args[0].target is dr.nn.prepare_bags and keys.args[1] == 0  # prepare_bags' unique keys


def test_explain_reports_partition_and_reasons():
    text = dr.optimize(build_model("dlrm", embedding="table"), dr.Config(smart_stage=True)).explain()
    assert "string_to_hash_bucket, " in text  # one hashing op for 26 columns
    assert "fill_missing" in text and "fill_missing x" not in text  # and one for the 13 dense columns
    assert "prepare_bags" in text.split("main (")[0]  # dedup and bag layout run in the stage
    assert "cut (7 values" in text and "batch['label']" in text and "prepare_bags[1]" in text
    assert "embeddings_collection_lookup: stateful module embeddings.collection.lookup (FusedLookup)" in text
    off = dr.optimize(build_model("dlrm", embedding="table")).explain()
    assert "SmartStage off" in off


def test_without_smart_stage_iterate_is_the_plain_loop(sample):
    model = build_model("dlrm", hash_buckets=100, embedding="table")
    fast = dr.optimize(model)
    before = set(threading.enumerate())
    losses = [o["loss"].item() for o in fast.iterate(CriteoReader(sample, 50))]
    assert losses == [model(b)["loss"].item() for b in CriteoReader(sample, 50)]
    assert set(threading.enumerate()) <= before  # no thread started (one an earlier test left may end)
