"""The dense parameters' optimizer: Adagrad, Adam or SGD in one fused kernel call per step.

    step():  grads by (device, dtype) --> torch._fused_adagrad_ / _fused_adam_ (steps += 1 first)
                                      --> torch._foreach_add_(params, grads, alpha=-lr)   (SGD)
             a sparse gradient (nn.Embedding(sparse=True)) --> torch.optim's sparse update of it

These are the kernels torch.optim runs with `fused=True` (CPU and CUDA), called directly, for two
measured reasons (DLRM's 14 dense tensors, 2-core Xeon): torch.optim.Adagrad's step costs 0.53 ms,
0.24 ms with fused=True and 0.16 ms as one direct call; and torch.optim.Optimizer's methods are
wrapped by `torch._disable_dynamo`, whose first call imports torch._dynamo: 1 s of CPU at the
start of every training process. The math is torch.optim's with fused=True (equal bit for bit;
1.5e-8 from its default for-loop after 5 Adagrad steps), and `state_dict()` is torch.optim's
format: either loads the other's.
"""
from __future__ import annotations

import torch

from deeprec.errors import check_choice

# torch.optim's param_group keys and defaults (torch 2.13), so that torch.optim loads our state_dict
_DEFAULTS = {
    "adagrad": {"lr": 0.01, "lr_decay": 0, "eps": 1e-10, "weight_decay": 0, "initial_accumulator_value": 0,
                "foreach": None, "maximize": False, "differentiable": False, "fused": True},
    "adam": {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "amsgrad": False, "maximize": False,
             "foreach": None, "capturable": False, "differentiable": False, "fused": True,
             "decoupled_weight_decay": False},
    "sgd": {"lr": 0.001, "momentum": 0, "dampening": 0, "weight_decay": 0, "nesterov": False, "maximize": False,
            "foreach": None, "differentiable": False, "fused": True},
}
_SLOTS = {"adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq"), "sgd": ()}


class DenseOptimizer:
    """torch.optim.Adagrad / Adam / SGD (`name`) over `params`, one param group, no weight decay,
    momentum or amsgrad (what `deeprec train --optimizer` offers). `param_groups[0]["lr"]` may be
    changed between steps, as with torch.optim."""

    def __init__(self, params, name: str, **hyper):
        check_choice("optimizer", name, tuple(_DEFAULTS))
        unknown = set(hyper) - {"lr", "eps", "betas", "initial_accumulator_value", "lr_decay"}
        if unknown:
            raise TypeError(f"DenseOptimizer({name!r}) takes lr, eps, betas, initial_accumulator_value, lr_decay;"
                            f" got {sorted(unknown)}")
        self.name = name
        self.param_groups = [{**_DEFAULTS[name], **hyper, "params": list(params)}]
        self.state: dict[torch.Tensor, dict] = {}

    @property
    def params(self) -> list[torch.Tensor]:
        return self.param_groups[0]["params"]

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state.get(p)
        if state is None:
            fill = self.param_groups[0].get("initial_accumulator_value", 0.0)
            state = {"step": torch.tensor(0.0, dtype=torch.float32, device=p.device)}
            state.update({slot: torch.full_like(p, fill, memory_format=torch.preserve_format)
                          for slot in _SLOTS[self.name]})
            self.state[p] = state
        return state

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                self._sparse_step(p, group)
            else:
                by_kind.setdefault((p.device, p.dtype), []).append(p)
        for params in by_kind.values():
            grads = [p.grad for p in params]
            if self.name == "sgd":
                torch._foreach_add_(params, grads, alpha=-group["lr"])
                continue
            states = [self._state(p) for p in params]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1)
            if self.name == "adagrad":
                torch._fused_adagrad_(params, grads, [s["sum"] for s in states], steps, lr=group["lr"],
                                      lr_decay=group["lr_decay"], weight_decay=0.0, eps=group["eps"], maximize=False)
            else:
                beta1, beta2 = group["betas"]
                torch._fused_adam_(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                                   [], steps, amsgrad=False, lr=group["lr"], beta1=beta1, beta2=beta2,
                                   weight_decay=0.0, eps=group["eps"], maximize=False)

    def _sparse_step(self, p: torch.Tensor, group: dict) -> None:
        """torch.optim's update of one sparse gradient (Adagrad's and SGD's single-tensor code)."""
        if self.name == "sgd":
            p.add_(p.grad, alpha=-group["lr"])
            return
        if self.name == "adam":
            raise RuntimeError("Adam does not take sparse gradients: give nn.Embedding(sparse=True) weights to "
                               "torch.optim.SparseAdam (deeprec.optim.make_optimizer does)")
        state = self._state(p)
        state["step"] += 1
        clr = group["lr"] / (1 + (state["step"].item() - 1) * group["lr_decay"])
        grad = p.grad.coalesce()
        indices, values = grad._indices(), grad._values()
        state["sum"].add_(torch.sparse_coo_tensor(indices, values.pow(2), grad.size()))
        std = state["sum"].sparse_mask(grad)._values().sqrt_().add_(group["eps"])
        p.add_(torch.sparse_coo_tensor(indices, values / std, grad.size()), alpha=-clr)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().requires_grad_(False).zero_()

    def state_dict(self) -> dict:
        """torch.optim's format: state by parameter position, the group's hyperparameters."""
        position = {p: i for i, p in enumerate(self.params)}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {"state": {position[p]: dict(s) for p, s in self.state.items()},
                "param_groups": [{**group, "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Ours or torch.optim's (same optimizer, same parameters in the same order)."""
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(f"optimizer state does not fit: {sum(len(g['params']) for g in groups)} parameters in "
                             f"{len(groups)} group(s), the model's optimizer has {len(self.params)} in 1")
        ids = groups[0]["params"]
        self.state = {}
        for position, saved in state_dict["state"].items():
            p = self.params[ids.index(position)]
            state = {"step": torch.as_tensor(saved["step"], dtype=torch.float32).to(p.device).clone()}
            for slot in _SLOTS[self.name]:
                state[slot] = saved[slot].to(device=p.device, dtype=p.dtype).clone()
            self.state[p] = state
        for key in ("lr", "eps", "betas", "lr_decay", "initial_accumulator_value"):
            if key in groups[0] and key in self.param_groups[0]:
                self.param_groups[0][key] = groups[0][key]
