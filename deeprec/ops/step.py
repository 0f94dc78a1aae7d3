"""Ops of the training step that ATen runs as several generic kernels, each one native pass
(deeprec/csrc/step_ops.cpp), differentiable, with fake kernels (torch.compile captures them as ops).
Where no backward is made (evaluation, an exported program) each is the ATen composition it stands
for, which inductor compiles into a serving package's own kernels.

    dot_interaction(x [B, N, D]) -> [B, N(N-1)/2]   DLRM's pairwise dots, pairs i > j in
        torch.tril_indices(N, N, -1)'s order: what `bmm(x, x^T).flatten(1)[:, pairs]` computes,
        without the [B, N, N] matrix, its zero-filled gradient and the scatter back
    gather_rows(rows [U, D], index [*S]) -> [*S, D]  rows[index]; the backward sums each row's
        gradients (index order: index_add's values) from the layout autograd hands over
    linear_relu(x [B, K], weight [N, K], bias [N]) -> [B, N]   relu(F.linear(x, weight, bias)): the bias
        and the ReLU in one pass after the GEMM, one autograd node in C++ (deeprec/csrc/linear_relu.cpp)

The native dots take float32, bf16 and half on the CPU, summed in float32 (converted there and back):
each over d in order, without fused multiply-adds, so the values equal a sequential sum's bits on every
CPU; they differ from bmm's (MKL's order) by float rounding only.
"""
from __future__ import annotations

import torch

from deeprec.ops.graph_op import op

_SUMMED_IN_FLOAT32 = (torch.float32, torch.bfloat16, torch.float16)  # what the native op takes


@op(pure=True)
def dot_interaction(x: torch.Tensor) -> torch.Tensor:
    """Pairwise dots of each sample's N vectors (the strictly lower triangle, row by row).

    The native op runs where a backward is made on the CPU (float32, bf16, half). Elsewhere it is bmm
    and index_select: without grad or in an exported program (evaluation, serving: inductor compiles
    them into a package's own kernels, where the native op is a call through AOTInductor's proxy
    executor, +50 us a DLRM request at 1 row), on a GPU (under autocast, in its dtype) and for float64.
    So evaluation under no_grad
    and the export score alike, bit for bit; a training forward differs from them by float rounding,
    and under bf16 autocast by more: its dots are float32 sums, evaluation's bf16 bmm."""
    if (x.device.type != "cpu" or x.dtype not in _SUMMED_IN_FLOAT32 or torch.compiler.is_exporting()
            or not (torch.is_grad_enabled() and x.requires_grad)):
        n = x.shape[1]
        pairs, within = torch.tril_indices(n, n, offset=-1, device=x.device)
        return torch.bmm(x, x.transpose(1, 2)).flatten(1).index_select(1, pairs * n + within)
    return torch.ops.deeprec.dot_interaction(x)


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows[index] ([*index.shape, D]), with a one-pass backward. An exported program (serving: no
    backward) holds index_select, the same values, which inductor compiles into the package's own
    kernels where a custom op would be a call through AOTInductor's proxy executor."""
    if torch.compiler.is_exporting():
        return rows.index_select(0, index.reshape(-1)).view(*index.shape, rows.shape[1])
    return torch.ops.deeprec.gather_rows(rows, index)


@op(pure=True)
def linear_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """relu(F.linear(x, weight, bias)), an MLP's hidden layer.

    Where a backward is made (training) in float32 on the CPU, on 2-D inputs, as one native op: the
    GEMM, then the bias and the ReLU in one pass (addmm copies the bias into the output first, and
    the ReLU writes a second output), with a C++ autograd node running the backward's ATen calls:
    DLRM's, WDL's and DeepFM's steps 1.04-1.05x. Its values differ from F.linear's by float rounding
    (the bias added after the sum, not first). Elsewhere it is the composition: evaluation and an
    exported program (which score alike, bit for bit, as before), torch.compile (which fuses it
    itself), bf16 autocast (where the op measured 0.97x: addmm adds the bias in float32 there)."""
    if (bias is None or x.dim() != 2 or x.device.type != "cpu" or x.dtype != torch.float32
            or torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.is_autocast_enabled("cpu")
            or not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad))):
        return torch.relu(torch.nn.functional.linear(x, weight, bias))
    return torch.ops.deeprec.linear_relu(x, weight, bias)


def _save_x(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _dot_interaction_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.deeprec.dot_interaction_backward(grad, x)


def _save_index(ctx, inputs, output):
    rows, index = inputs
    ctx.num_rows = rows.shape[0]
    ctx.save_for_backward(index)


def _gather_rows_backward(ctx, grad):
    (index,) = ctx.saved_tensors
    return torch.ops.deeprec.gather_rows_backward(grad, index, ctx.num_rows), None


torch.library.register_autograd("deeprec::dot_interaction", _dot_interaction_backward, setup_context=_save_x)
torch.library.register_autograd("deeprec::gather_rows", _gather_rows_backward, setup_context=_save_index)
