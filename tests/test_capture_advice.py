"""When forward cannot be traced, the CaptureError names the user's line and the fix for that
line; applying the advised fix makes the model trace. Ops returning several tensors trace as
tuples (iterable, indexable)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import deeprec as dr
from deeprec.graph import capture


def raw_batch():
    return {"x": torch.tensor([1.0, -2.0, 3.0]), "s": dr.Ragged.from_strings(["a", "b", "c"]),
            "t": dr.Ragged.from_strings(["d", "e", "f"])}


def _error(model) -> str:
    with pytest.raises(dr.CaptureError) as err:
        capture(model)
    return str(err.value)


class Gate(nn.Module):
    """A user's submodule with Python control flow on a tensor value."""

    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


class WithGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gate()

    def forward(self, batch):
        return self.gate(batch["x"]).sum()


def test_untraceable_submodule_is_told_to_become_a_leaf_and_then_traces():
    message = _error(WithGate())
    assert "test_capture_advice.py:" in message and "if x.sum() > 0:" in message
    assert "decorate `class Gate` with @deeprec.leaf_module" in message
    leaf_gate = type("LeafGate", (Gate,), {})
    dr.leaf_module(leaf_gate)  # the advised fix (as a decorator on the class, here on a subclass)
    model = WithGate()
    model.gate = leaf_gate()
    gm = capture(model)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["gate"]
    assert torch.equal(gm(raw_batch()), model(raw_batch()))


def test_control_flow_in_forward_is_told_to_move_into_an_op_and_then_traces():
    class Branchy(nn.Module):
        def forward(self, batch):
            x = batch["x"]
            if x.max() > 2:
                x = x / x.max()
            return x.sum()

    message = _error(Branchy())
    assert "if x.max() > 2:" in message and "Python control flow on tensor values" in message
    assert "@deeprec.op" in message

    @dr.op  # the advised fix: the lines moved into an op
    def scale(x):
        if x.max() > 2:
            x = x / x.max()
        return x

    class Fixed(nn.Module):
        def forward(self, batch):
            return scale(batch["x"]).sum()

    assert torch.equal(capture(Fixed())(raw_batch()), Branchy()(raw_batch()))


def test_len_is_told_to_use_shape_and_then_traces():
    class Counting(nn.Module):
        def forward(self, batch):
            return batch["x"].sum() / len(batch["x"])

    message = _error(Counting())
    assert "len(batch[\"x\"])" in message and "use `x.shape[0]`" in message

    class Fixed(nn.Module):
        def forward(self, batch):
            return batch["x"].sum() / batch["x"].shape[0]

    assert torch.equal(capture(Fixed())(raw_batch()), Counting()(raw_batch()))


def clip_negative(x):
    """A helper function with control flow, called from forward."""
    return x.clamp_min(0) if bool((x < 0).any()) else x


def test_helper_function_is_told_to_become_an_op_and_then_traces():
    class UsesHelper(nn.Module):
        def forward(self, batch):
            return clip_negative(batch["x"]).sum()

    message = _error(UsesHelper())
    assert "in the function clip_negative(): decorate it with @deeprec.op" in message
    helper = dr.op(clip_negative)  # the advised fix

    class Fixed(nn.Module):
        def forward(self, batch):
            return helper(batch["x"]).sum()

    assert torch.equal(capture(Fixed())(raw_batch()), UsesHelper()(raw_batch()))


def test_ops_returning_several_tensors_trace_as_tuples():
    class Loops(nn.Module):
        def forward(self, batch):
            keys = dr.ops.string_to_hash_key([batch["s"], batch["t"]])
            buckets = dr.ops.string_to_hash_bucket([batch["s"], batch["t"]], 7)
            unique, inverse = dr.ops.dedup(torch.cat(list(buckets)))
            total = sum(k.remainder(1000) for k in keys) + len(keys)  # iterated, len() of the op's result
            return total + buckets[1] + unique.sum() + inverse.sum()

    model = Loops()
    gm = capture(model)
    assert isinstance(dr.ops.string_to_hash_key([raw_batch()["s"]]), tuple)
    assert torch.equal(gm(raw_batch()), model(raw_batch()))
