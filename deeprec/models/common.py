"""Layers shared by the models: the MLP. Plain PyTorch (and deeprec's ops); nothing here knows about
training."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.nn.modules import module as _module

from deeprec.ops.graph_op import op
from deeprec.ops.step import linear_relu


def _hooked(layer: nn.Module) -> bool:
    """Whether calling `layer` would run a hook (its own or a global one, forward or backward)."""
    return bool(layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks
                or layer._backward_pre_hooks or _module._global_forward_hooks or _module._global_forward_pre_hooks
                or _module._global_backward_hooks or _module._global_backward_pre_hooks)


# pure: it writes none of its arguments (SmartStage and the shared-call merge rely on that); merging
# never happens (a module's get_attr is a new node at every call), and a layer's hooks are trusted as
# its call_module node trusted them
@op(pure=True)
def linear_then_relu(x: torch.Tensor, linear: nn.Linear, relu: nn.Module) -> torch.Tensor:
    """relu(linear(x)) through `deeprec.ops.step.linear_relu` (one op where a backward is made); through
    the modules themselves where one has a hook, so hooks registered on the layers still run. One graph
    node when traced, deciding when called (a hook registered after `dr.optimize` still counts)."""
    if _hooked(linear) or _hooked(relu):  # (no bias: linear_relu composes)
        return relu(linear(x))
    return linear_relu(x, linear.weight, linear.bias)


class MLP(nn.Sequential):
    """Linear + ReLU (+ optional BatchNorm) per hidden size; `out` adds a final linear layer.

    Each Linear + ReLU pair runs as `linear_then_relu`; the modules, their names and their state are
    nn.Sequential's."""

    def __init__(self, in_dim: int, hidden: Sequence[int], out: int | None = None, batch_norm: bool = False):
        layers: list[nn.Module] = []
        for width in hidden:
            layers += [nn.Linear(in_dim, width), nn.ReLU()]
            if batch_norm:
                layers.append(nn.BatchNorm1d(width))
            in_dim = width
        if out is not None:
            layers.append(nn.Linear(in_dim, out))
        super().__init__(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers, i = list(self), 0
        while i < len(layers):
            layer = layers[i]
            if type(layer) is nn.Linear and i + 1 < len(layers) and type(layers[i + 1]) is nn.ReLU:
                x, i = linear_then_relu(x, layer, layers[i + 1]), i + 2
            else:
                x, i = layer(x), i + 1
        return x
