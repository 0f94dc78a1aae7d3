"""deeprec/graph/shared_calls.py: a pure deeprec op called twice on the same inputs runs once; the
step computes the same bits; ops not declared pure, other arguments, and any graph that may write a
tensor in place are left alone."""
from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch import nn

import deeprec as dr
from deeprec.cli import sample_path
from deeprec.data import open_reader, resolve_schema
from deeprec.graph import capture
from deeprec.graph.shared_calls import merge_shared_calls
from deeprec.models import build_model
from deeprec.optim import make_optimizer

calls = {"pure": 0, "stateful": 0}


@dr.op(pure=True)
def doubled(x: torch.Tensor, scale: float) -> torch.Tensor:
    calls["pure"] += 1
    return x * scale


@dr.op(stateful=True)
def counted(x: torch.Tensor) -> torch.Tensor:
    calls["stateful"] += 1
    return x + calls["stateful"]


@dr.op(outputs=2, pure=True)
def halves(x: torch.Tensor):
    return x[:, :1], x[:, 1:]


@dr.op
def noisy(x: torch.Tensor) -> torch.Tensor:  # not declared pure (random numbers): never merged
    return x + torch.rand_like(x)


class Repeats(nn.Module):
    def forward(self, batch):
        x = batch["x"]
        a, b = doubled(x, 2.0), doubled(x, 2.0)      # merged
        c = doubled(x, 3.0)                           # another constant: kept
        d = doubled(x, -0.0) + doubled(x, 0.0)        # -0.0 and 0.0 differ: kept
        (f, _), (g, _) = halves(x), halves(x)         # a tuple result: merged, with its items
        return {"out": a + b + c + d + f + g}


def _targets(gm, fn) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is fn)


def test_repeated_pure_calls_merge_and_the_rest_stay():
    gm = capture(Repeats())
    assert (_targets(gm, doubled), _targets(gm, halves)) == (5, 2)
    x = torch.arange(6.0).reshape(3, 2)
    want = gm({"x": x})["out"]
    assert merge_shared_calls(gm) == 2
    assert (_targets(gm, doubled), _targets(gm, halves)) == (4, 1)
    items = [n for n in gm.graph.nodes if n.target is operator.getitem and n.args[0].target is halves]
    assert sorted(n.args[1] for n in items) == [0, 1]  # each item once: the second call's are the first's now
    calls["pure"] = 0
    assert torch.equal(gm({"x": x})["out"], want)
    assert calls["pure"] == 4  # 2.0 once, 3.0, -0.0 and 0.0


class NotPure(nn.Module):
    def forward(self, batch):
        x = batch["x"]
        h, i = noisy(x), noisy(x)       # random numbers: not declared pure
        d, e = counted(x), counted(x)   # stateful
        return {"out": doubled(x, 2.0) + doubled(x, 2.0) + 0 * (h + i) + d + e}


def test_ops_not_declared_pure_are_never_merged_nor_trusted():
    """A graph holding an op not declared pure (it might write its arguments) is left as it is."""
    gm = capture(NotPure())
    assert merge_shared_calls(gm) == 0
    assert (_targets(gm, noisy), _targets(gm, counted), _targets(gm, doubled)) == (2, 2, 2)


class OutputWritten(nn.Module):
    def forward(self, batch):
        a, b = doubled(batch["x"], 2.0), doubled(batch["x"], 2.0)
        b.add_(1.0)  # a merged call would hand `a` the +1 too
        return {"out": a + b}


class InputWritten(nn.Module):
    def forward(self, batch):
        x = batch["x"] * 1.0
        a = doubled(x, 2.0)
        x.mul_(3.0)  # the second call reads another x
        return {"out": a + doubled(x, 2.0)}


class ThroughAView(nn.Module):
    def forward(self, batch):
        a, b = doubled(batch["x"], 2.0), doubled(batch["x"], 2.0)
        torch.nn.functional.relu(b.view(-1), inplace=True)
        return {"out": a - b}


class ModuleInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, batch):
        a, b = doubled(batch["x"], 2.0), doubled(batch["x"], 2.0)
        self.act(b)
        return {"out": a - b}


@dr.op
def scaled_in_place(x: torch.Tensor) -> torch.Tensor:  # not declared pure: it may write its argument
    return x.mul_(10.0)


class OpInPlace(nn.Module):
    def forward(self, batch):
        x = batch["x"] * 1.0
        a = doubled(x, 2.0)
        scaled_in_place(x)
        return {"out": a + doubled(x, 2.0)}


class AtenInPlace(nn.Module):
    def forward(self, batch):
        a, b = doubled(batch["x"], 2.0), doubled(batch["x"], 2.0)
        torch.ops.aten.add_.Tensor(b, b)
        return {"out": a - b}


@pytest.mark.parametrize("model", [OutputWritten, InputWritten, ThroughAView, ModuleInPlace, OpInPlace, AtenInPlace])
def test_a_graph_that_may_write_in_place_is_left_as_it_is(model):
    gm = capture(model())
    x = torch.tensor([[-1.0, 2.0], [3.0, -4.0]])
    want = model()({"x": x.clone()})["out"]
    assert merge_shared_calls(gm) == 0
    assert _targets(gm, doubled) == 2
    assert torch.equal(gm({"x": x.clone()})["out"], want)


@dr.op(pure=True)
def pair(x: torch.Tensor):  # returns a tuple without declaring outputs: its items are taken by the model
    return x * 2, x * 3


class Items(nn.Module):
    def forward(self, batch):
        x = batch["x"]
        a, b = pair(x), pair(x)
        f = b[0] * 2       # an item of the second call used before the first call's item exists
        g = a[0]
        return {"out": f + g + doubled(x, 2.0)[:, :1] + doubled(x, 2.0)[:, :1]}


def test_items_and_slices_of_merged_calls_keep_the_graph_in_order():
    gm = capture(Items())
    x = torch.arange(6.0).reshape(3, 2)
    want = Items()({"x": x})["out"]
    assert merge_shared_calls(gm) == 2
    assert torch.equal(gm({"x": x})["out"], want)


@pytest.fixture(scope="module")
def batches():
    reader = iter(open_reader([sample_path()], 64, schema=resolve_schema([sample_path()], None)))
    return [next(reader) for _ in range(3)]


def _bag_calls(fast, batch) -> int:
    """How many times one forward of `fast` runs the native bag layout."""
    native, seen = torch.ops.deeprec.prepare_bags, []

    def counting(*args, **kwargs):
        seen.append(1)
        return native(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(torch.ops.deeprec, "prepare_bags", counting)
        fast(batch)
    return len(seen)


@pytest.mark.parametrize("name", ["wdl", "deepfm"])
def test_zoo_models_sharing_ids_lay_out_their_bags_once_with_the_same_step(name, batches):
    """Wide & Deep and DeepFM embed the same ids twice: one bag layout in the staged step, and training
    through it matches the plain model's, bit for bit, over several steps."""
    torch.manual_seed(0)
    plain = build_model(name)
    model = copy.deepcopy(plain)
    fast = dr.optimize(model, dr.Config(smart_stage=True))
    # the step itself lays out the bags once (counted on a copy: a forward inserts keys)
    assert _bag_calls(dr.optimize(copy.deepcopy(plain), dr.Config(smart_stage=True)), batches[0]) == 1
    assert _bag_calls(copy.deepcopy(plain), batches[0]) == 2
    assert fast.merged_calls == 1
    assert "shared calls: 1" in fast.explain()
    bags = [n for n in fast.graph_module.graph.nodes if getattr(n.target, "__name__", "") == "prepare_bags"]
    assert len(bags) == 1
    opt_plain, opt_fast = make_optimizer(plain, "adagrad", 0.01), make_optimizer(model, "adagrad", 0.01)
    for batch in batches:
        want, got = plain(batch), fast(batch)
        assert torch.equal(want["logits"], got["logits"])
        want["loss"].backward(), got["loss"].backward()
        opt_plain.step(), opt_fast.step()
        opt_plain.zero_grad(), opt_fast.zero_grad()
    for (n, p), (_, q) in zip(plain.named_parameters(), model.named_parameters()):
        assert torch.equal(p, q), n
