"""deeprec.optim.DenseOptimizer: torch.optim's math through its fused kernels, torch.optim's
state_dict format both ways, and a training process that never imports torch._dynamo."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from deeprec.optim import DenseOptimizer, make_optimizer

HYPER = {"adagrad": {"lr": 0.05, "initial_accumulator_value": 0.1}, "adam": {"lr": 0.01}, "sgd": {"lr": 0.1}}
TORCH = {"adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(13, 32), nn.ReLU(), nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 1))


def _train(model: nn.Module, opt, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(64, 13, generator=g), torch.rand(64, 1, generator=g)
        opt.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
        opt.step()


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("name", ["adagrad", "adam", "sgd"])
def test_it_steps_as_torch_optim_fused_bit_for_bit_and_as_the_default_within_1e_6(name):
    ours, fused, plain = _model(), _model(), _model()
    _train(ours, DenseOptimizer(ours.parameters(), name, **HYPER[name]), 6)
    _train(fused, TORCH[name](fused.parameters(), fused=True, **HYPER[name]), 6)
    _train(plain, TORCH[name](plain.parameters(), **HYPER[name]), 6)
    assert _equal(ours, fused)
    assert not _equal(ours, _model())  # it trained
    for p, q in zip(ours.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["adagrad", "adam"])
def test_its_state_dict_and_torch_optims_load_in_each_other(name):
    """A checkpoint written before (torch.optim's state) resumes in DenseOptimizer, and the other way."""
    ref = _model()
    ref_opt = TORCH[name](ref.parameters(), fused=True, **HYPER[name])
    _train(ref, ref_opt, 6)

    old = _model()  # 3 steps under torch.optim (default), then 3 under ours
    old_opt = TORCH[name](old.parameters(), **HYPER[name])
    _train(old, old_opt, 3)
    ours = DenseOptimizer(old.parameters(), name, **HYPER[name])
    ours.load_state_dict(old_opt.state_dict())
    _train(old, ours, 3, seed=2)

    new = _model()  # 3 under ours, then 3 under torch.optim (fused)
    mine = DenseOptimizer(new.parameters(), name, **HYPER[name])
    _train(new, mine, 3)
    theirs = TORCH[name](new.parameters(), fused=True, **HYPER[name])
    theirs.load_state_dict(mine.state_dict())
    _train(new, theirs, 3, seed=2)

    split = _model()  # the same 6 steps with the reference's data split as the others'
    split_opt = TORCH[name](split.parameters(), fused=True, **HYPER[name])
    _train(split, split_opt, 3)
    _train(split, split_opt, 3, seed=2)
    assert _equal(new, split)
    for p, q in zip(old.parameters(), split.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    assert mine.state_dict()["param_groups"][0]["lr"] == HYPER[name]["lr"]


@pytest.mark.parametrize("name", ["adagrad", "sgd"])
def test_a_sparse_gradient_steps_as_torch_optim(name):
    weights = []
    for make in (lambda p: DenseOptimizer(p, name, **HYPER[name]), lambda p: TORCH[name](p, **HYPER[name])):
        torch.manual_seed(0)
        emb, head = nn.Embedding(50, 4, sparse=True), nn.Linear(4, 1)
        opt = make([*emb.parameters(), *head.parameters()])
        g = torch.Generator().manual_seed(3)
        for _ in range(4):
            ids = torch.randint(0, 50, (32,), generator=g)  # repeats: the sparse gradient is coalesced
            opt.zero_grad()
            head(emb(ids)).sum().backward()
            assert emb.weight.grad.is_sparse
            opt.step()
        weights.append((emb.weight.detach().clone(), head.weight.detach().clone()))
    assert torch.equal(weights[0][0], weights[1][0])
    torch.testing.assert_close(weights[0][1], weights[1][1], atol=1e-6, rtol=0)


def test_adam_refuses_a_sparse_gradient_and_make_optimizer_gives_those_to_sparse_adam():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = DenseOptimizer(emb.parameters(), "adam", lr=0.01)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="SparseAdam"):
        opt.step()
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    kinds = [type(o).__name__ for o in make_optimizer(model, "adam").optimizers]
    assert kinds == ["DenseOptimizer", "SparseAdam"]


def test_an_unknown_name_or_hyperparameter_is_refused():
    with pytest.raises(Exception, match="optimizer.*adagrad"):
        DenseOptimizer([], "rmsprop")
    with pytest.raises(TypeError, match="momentum"):
        DenseOptimizer([], "sgd", momentum=0.9)


def test_a_training_process_does_not_import_torch_dynamo():
    """torch.optim's methods import torch._dynamo at their first call: 1 s of every process's start."""
    code = ("import sys; from deeprec.cli import main; "
            "main(['train', '--model', 'dlrm', '--synthetic', '1000', '--steps', '3']); "
            "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "no dynamo"
