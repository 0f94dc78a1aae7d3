"""Row-sparse optimizers: update only the rows a batch touched.

Each optimizer applies, in place, to `weight[rows]` and its slots `slots[name][rows]`,
with `rows` unique (duplicate ids' gradients are summed first, see `deeprec.nn.lookup.merge_rows`): so
updates are gathers and scatters of distinct rows, never accumulating scatters.
SGD, Adagrad, Adam and AdamAsync run as one C++ pass over the rows
(deeprec/csrc/sparse_optim.cpp, no GIL); FTRL is a composition of torch ops.
Slots are plain tensors with one row per embedding row, owned by the embedding
(an EmbeddingVariable grows them with its key index). The math of each class
matches the named torch.optim class restricted to those rows (tests check it).

    SGD        w -= lr * g
    Adagrad    acc += g^2;  w -= lr * g / (sqrt(acc) + eps)              (torch.optim.Adagrad)
    Adam       lazy Adam: m, v of touched rows only, bias correction by the
               global step count                                          (torch.optim.SparseAdam)
    AdamAsync  like Adam, but each row's bias correction uses that row's own
               update count, as DeepRec's AdamAsync (no global beta powers)
    FTRL       TF's FTRL-proximal (l1, l2, lr_power) with an optional group
               lasso `l21` that zeroes whole rows
"""
from __future__ import annotations

import math

import torch

import deeprec._C  # noqa: F401  (registers torch.ops.deeprec.sparse_*)
from deeprec.errors import ConfigError


class RowSparseOptimizer:
    """Base: `slots` declares per-row state as {name: initial value}."""

    slots: dict[str, float] = {}
    row_slots: dict[str, float] = {}  # one value per row (not per element)

    def __init__(self, lr: float):
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.lr = lr
        self.step_count = 0

    def init_slots(self, num_rows: int, dim: int, device=None) -> dict[str, torch.Tensor]:
        out = {name: torch.full((num_rows, dim), value, device=device) for name, value in self.slots.items()}
        out.update({name: torch.full((num_rows,), value, device=device) for name, value in self.row_slots.items()})
        return out

    def slot_specs(self) -> dict[str, tuple[float, bool]]:
        """{slot name: (initial value, one per element?)}: what a table must hold for this optimizer."""
        return {**{n: (v, True) for n, v in self.slots.items()}, **{n: (v, False) for n, v in self.row_slots.items()}}

    def begin_step(self) -> None:
        """Called once per optimizer step, before the rows' updates."""
        self.step_count += 1

    def update(self, weight: torch.Tensor, slots: dict, rows: torch.Tensor, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def fused(self) -> tuple[str, list[str], list[float]] | None:
        """(kernel, slot names, hyper-parameters) of deeprec::ev_apply_, which updates many
        EmbeddingVariables in one call; None: this optimizer has no such kernel."""
        return None

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])


class SGD(RowSparseOptimizer):
    def update(self, weight, slots, rows, grad):
        torch.ops.deeprec.sparse_sgd_(weight, rows, grad.contiguous(), self.lr)

    def fused(self):
        return "sgd", [], [self.lr]


class Adagrad(RowSparseOptimizer):
    def __init__(self, lr: float = 0.01, initial_accumulator_value: float = 0.1, eps: float = 1e-10):
        super().__init__(lr)
        self.eps = eps
        self.slots = {"accumulator": initial_accumulator_value}

    def update(self, weight, slots, rows, grad):
        torch.ops.deeprec.sparse_adagrad_(weight, slots["accumulator"], rows, grad.contiguous(), self.lr, self.eps)

    def fused(self):
        return "adagrad", ["accumulator"], [self.lr, self.eps]


class Adam(RowSparseOptimizer):
    def __init__(self, lr: float = 0.001, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        super().__init__(lr)
        self.betas, self.eps = betas, eps
        self.slots = {"exp_avg": 0.0, "exp_avg_sq": 0.0}

    def update(self, weight, slots, rows, grad):
        torch.ops.deeprec.sparse_adam_(weight, slots["exp_avg"], slots["exp_avg_sq"], slots.get("row_step"), rows,
                                       grad.contiguous(), self.lr, *self.betas, self.eps, self.step_count)

    def fused(self):
        return "adam", ["exp_avg", "exp_avg_sq", *self.row_slots], [self.lr, *self.betas, self.eps]


class AdamAsync(Adam):
    """Adam whose bias correction counts each row's own updates (the `row_step` slot)."""

    def __init__(self, lr: float = 0.001, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        super().__init__(lr, betas, eps)
        self.row_slots = {"row_step": 0.0}


class FTRL(RowSparseOptimizer):
    def __init__(self, lr: float = 0.05, lr_power: float = -0.5, l1: float = 0.0, l2: float = 0.0,
                 l21: float = 0.0, initial_accumulator_value: float = 0.1):
        super().__init__(lr)
        if lr_power > 0:
            raise ValueError(f"lr_power must be <= 0, got {lr_power}")
        self.lr_power, self.l1, self.l2, self.l21 = lr_power, l1, l2, l21
        self.slots = {"accumulator": initial_accumulator_value, "linear": 0.0}

    def update(self, weight, slots, rows, grad):
        acc = slots["accumulator"].index_select(0, rows)
        linear = slots["linear"].index_select(0, rows)
        w = weight.index_select(0, rows)
        new_acc = acc + grad * grad
        p = -self.lr_power
        sigma = (new_acc.pow(p) - acc.pow(p)) / self.lr
        linear.add_(grad - sigma * w)
        quadratic = new_acc.pow(p) / self.lr + 2 * self.l2
        shrunk = torch.sign(linear) * torch.clamp(linear.abs() - self.l1, min=0.0)  # l1 soft threshold
        new_w = -shrunk / quadratic
        if self.l21 > 0:  # group lasso: a row survives only if its shrunk linear term is large enough
            norm = shrunk.norm(dim=1, keepdim=True)
            threshold = self.l21 * math.sqrt(w.shape[1])
            new_w = new_w * torch.clamp(1 - threshold / norm.clamp_min(1e-30), min=0.0)
        slots["accumulator"].index_copy_(0, rows, new_acc)
        slots["linear"].index_copy_(0, rows, linear)
        weight.index_copy_(0, rows, new_w)


ROW_SPARSE = {"sgd": SGD, "adagrad": Adagrad, "adam": Adam, "adamasync": AdamAsync, "ftrl": FTRL}  # the one name map


def row_sparse_optimizer(name: str, lr: float, error: type[Exception] = ConfigError) -> RowSparseOptimizer:
    """The row-sparse optimizer `name` (a key of ROW_SPARSE) with its defaults; a bad name or lr
    raises `error` (the PS answers a bad request with its WireError)."""
    if name not in ROW_SPARSE:
        raise error(f"optimizer {name!r} is not one of {', '.join(ROW_SPARSE)}")
    try:
        return ROW_SPARSE[name](lr=lr)
    except ValueError as err:  # lr <= 0 and the like
        raise error(f"optimizer {name!r}: {err}") from None
