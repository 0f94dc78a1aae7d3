"""Row-sparse optimizers against torch.optim on the same rows."""
import math

import numpy as np
import pytest
import torch

from deeprec import optim
from deeprec.nn.lookup import merge_rows


def run_ours(opt, weight, steps):
    w = weight.clone()
    slots = opt.init_slots(*w.shape)
    for rows, grad in steps:
        opt.begin_step()
        r, g = merge_rows(rows, grad)
        opt.update(w, slots, r, g)
    return w, slots


def run_torch(make, weight, steps, sparse=False):
    p = torch.nn.Parameter(weight.clone())
    opt = make([p])
    for rows, grad in steps:
        if sparse:
            p.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), grad, p.shape)
        else:
            dense = torch.zeros_like(p)
            dense.index_add_(0, rows, grad)
            p.grad = dense
        opt.step()
    return p.detach()


def make_steps(n_rows=20, dim=4, steps=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        rows = torch.randint(0, n_rows // 2, (12,), generator=g)  # duplicates, rows >= 10 untouched
        out.append((rows, torch.randn(12, dim, generator=g)))
    return out


@pytest.fixture
def weight():
    return torch.randn(20, 4, generator=torch.Generator().manual_seed(1))


def test_merge_rows_sums_duplicates():
    rows, grads = merge_rows(torch.tensor([3, 1, 3]), torch.tensor([[1.0], [2.0], [4.0]]))
    assert rows.tolist() == [1, 3] and grads.tolist() == [[2.0], [5.0]]
    rows, grads = merge_rows(torch.tensor([5, 2]), torch.tensor([[1.0], [2.0]]))
    assert rows.tolist() == [2, 5] and grads.tolist() == [[2.0], [1.0]]


def test_sgd_matches_torch(weight):
    steps = make_steps()
    ours, _ = run_ours(optim.SGD(lr=0.1), weight, steps)
    assert torch.allclose(ours, run_torch(lambda p: torch.optim.SGD(p, lr=0.1), weight, steps), atol=1e-6)


def test_adagrad_matches_torch(weight):
    steps = make_steps()
    ours, slots = run_ours(optim.Adagrad(lr=0.1, initial_accumulator_value=0.1, eps=1e-10), weight, steps)
    ref = run_torch(lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1, eps=1e-10),
                    weight, steps)
    assert torch.allclose(ours, ref, atol=1e-6)
    assert torch.equal(ours[10:], weight[10:]) and (slots["accumulator"][10:] == 0.1).all()


def test_adam_is_torch_sparse_adam(weight):
    steps = make_steps()
    ours, _ = run_ours(optim.Adam(lr=0.01), weight, steps)
    ref = run_torch(lambda p: torch.optim.SparseAdam(p, lr=0.01), weight, steps, sparse=True)
    assert torch.allclose(ours, ref, atol=1e-6)


def test_adam_async_corrects_bias_per_row(weight):
    # each row equals torch Adam run on that row alone, counting only the steps that touched it
    steps = make_steps()
    ours, slots = run_ours(optim.AdamAsync(lr=0.01), weight, steps)
    for row in range(20):
        row_steps = []
        for rows, grad in steps:
            hit = rows == row
            if hit.any():
                row_steps.append((torch.tensor([0]), grad[hit].sum(0, keepdim=True)))
        ref = run_torch(lambda p: torch.optim.Adam(p, lr=0.01), weight[row:row + 1], row_steps)
        assert torch.allclose(ours[row:row + 1], ref, atol=1e-6), row
        assert slots["row_step"][row] == len(row_steps)


def ftrl_reference(w, steps, lr, lr_power, l1, l2, init_acc):
    """TF's FTRL-proximal update, element by element (tf.raw_ops.ApplyFtrl)."""
    w = w.numpy().astype(np.float64).copy()
    acc = np.full_like(w, init_acc)
    linear = np.zeros_like(w)
    for rows, grad in steps:
        g = np.zeros_like(w)
        np.add.at(g, rows.numpy(), grad.numpy().astype(np.float64))
        for r in np.unique(rows.numpy()):
            for j in range(w.shape[1]):
                new_acc = acc[r, j] + g[r, j] ** 2
                sigma = (new_acc ** -lr_power - acc[r, j] ** -lr_power) / lr
                linear[r, j] += g[r, j] - sigma * w[r, j]
                quadratic = new_acc ** -lr_power / lr + 2 * l2
                w[r, j] = ((np.sign(linear[r, j]) * l1 - linear[r, j]) / quadratic
                           if abs(linear[r, j]) > l1 else 0.0)
                acc[r, j] = new_acc
    return torch.from_numpy(w).float()


@pytest.mark.parametrize("l1,l2", [(0.0, 0.0), (0.05, 0.1)])
def test_ftrl_matches_tf_formula(weight, l1, l2):
    steps = make_steps()
    ours, _ = run_ours(optim.FTRL(lr=0.1, l1=l1, l2=l2), weight, steps)
    ref = ftrl_reference(weight, steps, 0.1, -0.5, l1, l2, 0.1)
    touched = torch.unique(torch.cat([r for r, _ in steps]))
    assert torch.allclose(ours[touched], ref[touched], atol=1e-5)
    assert torch.equal(ours[10:], weight[10:])


def test_ftrl_group_lasso_zeroes_whole_rows(weight):
    steps = make_steps()
    strong, _ = run_ours(optim.FTRL(lr=0.1, l21=1e3), weight, steps)
    touched = torch.unique(torch.cat([r for r, _ in steps]))
    assert (strong[touched] == 0).all()
    mild, _ = run_ours(optim.FTRL(lr=0.1, l21=1e-4), weight, steps)
    plain, _ = run_ours(optim.FTRL(lr=0.1), weight, steps)
    assert torch.allclose(mild, plain, atol=1e-3) and (mild[touched].abs().sum(1) > 0).all()
    assert math.isclose(float(mild[touched].norm()), float(plain[touched].norm()), rel_tol=1e-2)


@pytest.mark.parametrize("dim", [16, 19, 64])  # whole vectors, a scalar tail, several vectors per row
def test_fused_kernels_match_torch_at_vector_widths(dim):
    weight = torch.randn(40, dim, generator=torch.Generator().manual_seed(2))
    steps = [(rows, torch.randn(12, dim, generator=torch.Generator().manual_seed(i))) for i, (rows, _) in
             enumerate(make_steps(n_rows=40))]
    for ours_opt, make in [(optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
                           (optim.Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1,
                                                                                  eps=1e-10)),
                           (optim.Adam(lr=0.01), lambda p: torch.optim.SparseAdam(p, lr=0.01))]:
        ours, _ = run_ours(ours_opt, weight, steps)
        touched = torch.unique(torch.cat([r for r, _ in steps]))
        ref = run_torch(make, weight, steps, sparse=isinstance(ours_opt, optim.Adam))
        assert torch.allclose(ours[touched], ref[touched], atol=1e-6), type(ours_opt).__name__
        assert torch.equal(ours[20:], weight[20:])


def test_fused_kernels_pass_opcheck():
    w, s1, s2 = torch.randn(10, 8), torch.rand(10, 8) + 0.1, torch.rand(10, 8)
    rows, grad = torch.tensor([3, 0, 7]), torch.randn(3, 8)
    ops = torch.ops.deeprec
    torch.library.opcheck(ops.sparse_sgd_, (w.clone(), rows, grad, 0.1))
    torch.library.opcheck(ops.sparse_adagrad_, (w.clone(), s1.clone(), rows, grad, 0.1, 1e-10))
    torch.library.opcheck(ops.sparse_adam_, (w.clone(), s1.clone(), s2.clone(), None, rows, grad, 0.1, 0.9, 0.999,
                                             1e-8, 3))
    torch.library.opcheck(ops.sparse_adam_, (w.clone(), s1.clone(), s2.clone(), torch.zeros(10), rows, grad, 0.1,
                                             0.9, 0.999, 1e-8, 1))


def test_fused_kernels_refuse_bad_rows_and_layouts():
    w, acc, grad = torch.zeros(10, 4), torch.zeros(10, 4), torch.ones(2, 4)
    with pytest.raises(RuntimeError, match=r"row 10 out of range \[0, 10\)"):
        torch.ops.deeprec.sparse_adagrad_(w, acc, torch.tensor([1, 10]), grad, 0.1, 1e-10)
    with pytest.raises(RuntimeError, match="row -1 out of range"):
        torch.ops.deeprec.sparse_sgd_(w, torch.tensor([-1, 2]), grad, 0.1)
    with pytest.raises(RuntimeError, match="shaped and laid out like weight"):
        torch.ops.deeprec.sparse_adagrad_(w, torch.zeros(10, 5), torch.tensor([1, 2]), grad, 0.1, 1e-10)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.deeprec.sparse_sgd_(torch.zeros(4, 10).t(), torch.tensor([1, 2]), grad, 0.1)
    assert (w == 0).all() and (acc == 0).all()  # nothing written before the checks passed
