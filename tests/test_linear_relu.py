"""deeprec.ops.step.linear_relu (deeprec/csrc/linear_relu.cpp): an MLP's Linear + ReLU as one op where a
backward is made, the composition elsewhere; the zoo's MLP runs its pairs through it."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from deeprec.models.common import MLP
from deeprec.ops.step import linear_relu


def _layer(batch: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) / 4
    return x, w, b


def _run(fn, x, w, b, grad):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = fn(x, w, b)
    y.backward(grad)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("k", [13, 367, 512])  # K = 512: MKL may add the bias before a second block
def test_the_op_and_its_backward_equal_linear_then_relu(k):
    x, w, b = _layer(64, k, 96)
    grad = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    got = _run(linear_relu, x, w, b, grad)
    want = _run(lambda x, w, b: torch.relu(F.linear(x, w, b)), x, w, b, grad)
    for g, v, name in zip(got, want, ("output", "x.grad", "weight.grad", "bias.grad")):
        torch.testing.assert_close(g, v, rtol=1e-5, atol=1e-5, msg=name)
    y = linear_relu(*(t.clone().requires_grad_() for t in (x, w, b)))
    assert "LinearRelu" in y.grad_fn.name() and (y >= 0).all()  # one node, the C++ one


def test_nan_passes_the_relu_as_torch_relu():
    x, w, b = _layer(5, 16, 64)  # 64 columns: the vectorized loop, and its tail
    b[5], b[63] = float("nan"), float("inf")
    got = linear_relu(x, w.requires_grad_(), b.requires_grad_())
    want = torch.relu(F.linear(x, w, b))
    assert got[:, 5].isnan().all() and torch.equal(got.isnan(), want.isnan()) and torch.isinf(got[:, 63]).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert (got[~got.isnan()] >= 0).all()


class _GemmCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.mm += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("needs, gemms", [((True, True, True), 2), ((False, True, True), 1), ((False, False, True), 0)])
def test_the_backward_computes_only_the_gradients_asked_for(needs, gemms):
    x, w, b = (t.requires_grad_(need) for t, need in zip(_layer(8, 5, 3), needs))
    y = linear_relu(x, w, b)
    assert "LinearRelu" in y.grad_fn.name()
    with _GemmCount() as count:
        y.sum().backward()
    assert count.mm == gemms  # dx = grad @ weight, dweight = grad^T @ x: each only when wanted
    assert [t.grad is not None for t in (x, w, b)] == list(needs)


def test_a_missing_bias_is_the_composition():
    x, w, _ = _layer(6, 4, 3)
    assert torch.equal(linear_relu(x, w.requires_grad_(), None), torch.relu(F.linear(x, w)))


def test_without_a_backward_or_under_autocast_it_is_the_composition_bit_for_bit():
    x, w, b = _layer(32, 40, 24)
    want = torch.relu(F.linear(x, w, b))
    with torch.no_grad():  # evaluation: the composition, as an exported program holds it
        assert torch.equal(linear_relu(x, w.requires_grad_(), b.requires_grad_()), want)
    w, b = w.detach(), b.detach()
    assert torch.equal(linear_relu(x, w, b), want)  # nothing requires grad
    exported = torch.export.export(_Pair(w, b), (x,))
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert not any(t.startswith("deeprec.") for t in targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_relu(x, w.requires_grad_(), b.requires_grad_())
        composed = torch.relu(F.linear(x, w, b))
    assert got.dtype == torch.bfloat16 and torch.equal(got, composed)


def test_the_native_op_under_autocast_casts_as_linear_does():
    x, w, b = _layer(16, 24, 8)
    w, b = w.requires_grad_(), b.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.ops.deeprec.linear_relu(x, w, b)  # the op itself (the wrapper keeps autocast composed)
        want = torch.relu(F.linear(x, w, b))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    got.float().sum().backward()
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32


def test_bad_shapes_are_named():
    x, w, b = _layer(4, 6, 3)
    with pytest.raises(RuntimeError, match=r"linear_relu: x \[B, K\], weight \[N, K\] and bias \[N\]"):
        torch.ops.deeprec.linear_relu(x, w.t().contiguous(), b)


class _Pair(torch.nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.w, self.b = torch.nn.Parameter(w), torch.nn.Parameter(b)

    def forward(self, x):
        return linear_relu(x, self.w, self.b)


def _node_names(y: torch.Tensor) -> list[str]:
    names, seen, stack = [], set(), [y.grad_fn]
    while stack:  # the autograd graph's node types
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(node.name())
        stack += [n for n, _ in node.next_functions]
    return names


def test_a_hook_on_a_layer_runs_its_pair_as_the_modules():
    torch.manual_seed(0)
    mlp, x, seen = MLP(6, [8], out=1), torch.randn(4, 6), []
    handle = mlp[0].register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    y = mlp(x)
    assert seen == [(4, 8)] and not any("LinearRelu" in n for n in _node_names(y))
    handle.remove()
    assert any("LinearRelu" in n for n in _node_names(mlp(x))) and seen == [(4, 8)]
    handle = mlp[1].register_full_backward_hook(lambda module, grad_in, grad_out: seen.append("backward"))
    mlp(x).sum().backward()
    assert seen == [(4, 8), "backward"]
    handle.remove()


def test_the_mlp_runs_its_pairs_through_the_op_and_keeps_its_modules():
    torch.manual_seed(0)
    mlp = MLP(13, [64, 32], out=1)
    assert list(mlp.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    x = torch.randn(20, 13)
    y = mlp(x)
    names = _node_names(y)
    assert sum("LinearRelu" in n for n in names) == 2 and "ReluBackward0" not in names
    composed = x
    for layer in mlp:
        composed = layer(composed)
    torch.testing.assert_close(y, composed, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(mlp(x), torch.nn.Sequential(*mlp)(x))  # evaluation: nn.Sequential's own values
    bn = MLP(8, [16], batch_norm=True)  # Linear, ReLU, BatchNorm: the pair, then the norm
    bn(torch.randn(10, 8)).sum().backward()
    assert bn[0].weight.grad is not None and bn[2].weight.grad is not None
