"""The step's native ops (deeprec/csrc/step_ops.cpp): DLRM's pairwise dots and the row gather with a
one-pass backward. Their values are checked against the sums they promise, bit for bit, and against
the ATen compositions they replace; torch.export and torch.compile see them as ops."""
import pytest
import torch

from deeprec.ops.step import dot_interaction, gather_rows


def _pairs(n):
    return torch.tril_indices(n, n, offset=-1)


def _sequential_dots(x):
    """out[b, p] = sum over d, in order, of x[b, i, d] * x[b, j, d]: separate multiply and add in float32."""
    rows, cols = _pairs(x.shape[1])
    xi, xj = x[:, rows], x[:, cols]
    out = torch.zeros(xi.shape[:2])
    for d in range(x.shape[2]):
        out = out + xi[:, :, d] * xj[:, :, d]
    return out


def _sequential_dots_backward(grad, x):
    """dx[b, i] = sum over j ascending of g[b, i, j] * x[b, j] (g symmetric, zero diagonal)."""
    b, n, _ = x.shape
    rows, cols = _pairs(n)
    g = torch.zeros(b, n, n)
    g[:, rows, cols] = grad
    g[:, cols, rows] = grad
    dx = torch.zeros_like(x)
    for j in range(n):
        dx = dx + g[:, :, j:j + 1] * x[:, j:j + 1, :]
    return dx


@pytest.mark.parametrize("n,d", [(27, 16), (2, 16), (5, 3), (40, 33), (17, 48)])
def test_dot_interaction_is_the_ordered_sum_and_matches_bmm(n, d):
    torch.manual_seed(n * 100 + d)
    x = torch.randn(70, n, d, requires_grad=True)
    out = dot_interaction(x)
    assert out.shape == (70, n * (n - 1) // 2)
    assert torch.equal(out, _sequential_dots(x.detach()))
    rows, cols = _pairs(n)
    twin = x.detach().clone().requires_grad_()
    plain = torch.bmm(twin, twin.transpose(1, 2))[:, rows, cols]
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)

    grad = torch.randn_like(out)
    out.backward(grad)
    plain.backward(grad)
    assert torch.equal(x.grad, _sequential_dots_backward(grad, x.detach()))
    torch.testing.assert_close(x.grad, twin.grad, rtol=1e-5, atol=1e-5)


def test_dot_interaction_reads_any_layout_and_keeps_the_dtype():
    torch.manual_seed(0)
    x = torch.randn(16, 20, 9).transpose(0, 1)  # [20, 16, 9], not contiguous
    assert torch.equal(torch.ops.deeprec.dot_interaction(x), _sequential_dots(x.contiguous()))
    half = torch.randn(8, 6, 16).to(torch.bfloat16)
    out = torch.ops.deeprec.dot_interaction(half)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, _sequential_dots(half.float()).to(torch.bfloat16))
    wide = torch.randn(6, 7, 5, dtype=torch.float64, requires_grad=True)  # float64: bmm, in float64
    rows, cols = _pairs(7)
    assert torch.equal(dot_interaction(wide), torch.bmm(wide, wide.transpose(1, 2))[:, rows, cols])
    with pytest.raises(RuntimeError, match=r"x must be float32, bfloat16 or float16"):
        torch.ops.deeprec.dot_interaction(wide.detach())
    with pytest.raises(RuntimeError, match=r"x must be \[batch, vectors, dim\]"):
        torch.ops.deeprec.dot_interaction(torch.randn(4, 5))


@pytest.mark.parametrize("index_shape", [(300,), (6, 50)])
def test_gather_rows_equals_index_select_and_its_gradient_index_add(index_shape):
    torch.manual_seed(1)
    rows = torch.randn(40, 16, requires_grad=True)
    index = torch.randint(0, 40, index_shape)
    out = gather_rows(rows, index)
    assert out.shape == (*index_shape, 16)
    assert torch.equal(out, rows.detach().index_select(0, index.reshape(-1)).view(*index_shape, 16))
    # the gradient arrives as a transposed view, as autograd hands it over from [B, P, D]
    upstream = torch.randn(*reversed(index_shape), 16).transpose(0, len(index_shape) - 1) if len(index_shape) == 2 \
        else torch.randn(16, index_shape[0]).t()
    out.backward(upstream)
    expected = torch.zeros(40, 16).index_add_(0, index.reshape(-1), upstream.reshape(-1, 16))
    assert torch.equal(rows.grad, expected)  # the same order of additions: the same bits


def test_gather_rows_backward_refuses_an_index_out_of_range():
    with pytest.raises(RuntimeError, match=r"index 9 out of range \[0, 5\)"):
        torch.ops.deeprec.gather_rows_backward(torch.ones(3, 4), torch.tensor([0, 9, 1]), 5)


class _Interaction(torch.nn.Module):
    def forward(self, rows, index):
        vectors = gather_rows(rows, index).transpose(0, 1)
        return dot_interaction(vectors).sum(1)


def test_compile_sees_the_ops_and_export_holds_their_aten_form():
    """torch.compile (training) traces the native ops with their fake kernels and backwards; an exported
    program (serving) and evaluation hold bmm / index_select, the same values as each other."""
    rows, index = torch.randn(30, 8), torch.randint(0, 30, (5, 12))
    model = _Interaction()
    exported = torch.export.export(model, (rows, index))
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert not any(t.startswith("deeprec.") for t in targets) and "aten.bmm.default" in targets
    with torch.no_grad():
        assert torch.equal(exported.module()(rows, index), model(rows, index))
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    backend = AotEagerAndRecordGraphs()  # AOTAutograd: the forward and backward graphs, fake kernels run
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    leaf = rows.clone().requires_grad_()
    compiled(leaf, index).sum().backward()
    forward = {str(n.target) for g in backend.fw_graphs for n in g.graph.nodes}
    backward = {str(n.target) for g in backend.bw_graphs for n in g.graph.nodes}
    assert {"deeprec.dot_interaction.default", "deeprec.gather_rows.default"} <= forward
    assert {"deeprec.dot_interaction_backward.default", "deeprec.gather_rows_backward.default"} <= backward
    eager = rows.clone().requires_grad_()
    model(eager, index).sum().backward()
    assert torch.equal(leaf.grad, eager.grad)


def test_without_a_backward_the_dots_are_bmms():
    torch.manual_seed(3)
    x = torch.randn(40, 9, 16)
    rows, cols = _pairs(9)
    with torch.no_grad():
        assert torch.equal(dot_interaction(x.requires_grad_()), torch.bmm(x, x.transpose(1, 2))[:, rows, cols])
    assert torch.equal(dot_interaction(x.detach()), torch.bmm(x, x.transpose(1, 2)).detach()[:, rows, cols])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ops_on_cuda_equal_the_cpu():
    torch.manual_seed(2)
    x = torch.randn(32, 27, 16, dtype=torch.float64)
    on_cpu, on_gpu = x.float().requires_grad_(), x.float().cuda().requires_grad_()
    cpu, gpu = dot_interaction(on_cpu), dot_interaction(on_gpu)  # the native op; bmm on the GPU
    torch.testing.assert_close(gpu.detach().cpu(), cpu.detach(), rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(cpu)
    cpu.backward(grad)
    gpu.backward(grad.cuda())
    torch.testing.assert_close(on_gpu.grad.cpu(), on_cpu.grad, rtol=1e-5, atol=1e-5)
    vectors = torch.randn(8, 5, 16, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):  # autocast applies to the bmm, as without the op
        dots = dot_interaction(vectors)
    assert dots.dtype == torch.bfloat16
    dots.float().sum().backward()
    assert vectors.grad.dtype == torch.float32
    rows, index = torch.randn(50, 16), torch.randint(0, 50, (4, 20))
    g = torch.randn(4, 20, 16)
    assert torch.equal(gather_rows(rows.cuda(), index.cuda()).cpu(), gather_rows(rows, index))
    torch.testing.assert_close(torch.ops.deeprec.gather_rows_backward(g.cuda(), index.cuda(), 50).cpu(),
                               torch.ops.deeprec.gather_rows_backward(g, index, 50))
