"""Bag preparation and the fused row gather behind `EmbeddingCollection`.

    ids of F features ──prepare_bags (pure: SmartStage can run it ahead)──>
        per-feature unique keys, global inverse, bag offsets, combiner weights
    ──RowGather (one gather; its backward hands the unique rows' gradient to a
      row-sparse optimizer, fused)──> rows [U, D]
    ──max_norm, embedding_bag(sum, per-sample weights)──> [B, F, D]

Combiners are per-sample weights of one "sum" bag reduction: sum -> 1,
mean -> 1/n, sqrtn -> 1/sqrt(n); autograd differentiates them (so sqrtn's
backward is the true gradient of the unfused formula).
"""
from __future__ import annotations

from typing import Sequence

import torch

from deeprec.ops.graph_op import op
from deeprec.ragged import Ragged

COMBINERS = ("sum", "mean", "sqrtn")



_COMBINER_CODES = {name: code for code, name in enumerate(COMBINERS)}  # as deeprec/csrc/bags.cpp numbers them
_NO_OFFSETS = torch.empty(0, dtype=torch.long)


def _as_ids(ids) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(flat int64 ids, offsets or empty for a fixed width, rows) of [B] ids, [B, L] ids, or a Ragged."""
    if isinstance(ids, tuple) and len(ids) == 2:
        values, offsets = ids
        return values.reshape(-1).long().cpu(), offsets.long().cpu(), offsets.numel() - 1
    ids = torch.as_tensor(ids)
    if ids.dim() not in (1, 2):
        raise ValueError(f"ids must be [B], [B, L] or Ragged(values, offsets), got shape {tuple(ids.shape)}")
    return ids.reshape(-1).long().cpu(), _NO_OFFSETS, ids.shape[0]


@op
def prepare_bags(ids: Sequence, combiners: Sequence[str], fill_ids: Sequence):
    """Prune negative ids, fill empty bags, dedup per feature, and lay out all
    F x B bags (feature-major) for one bag reduction: one native op for every feature
    (`torch.ops.deeprec.prepare_bags`, deeprec/csrc/bags.cpp; it runs without the GIL).

    Returns (unique keys per feature, global inverse, offsets [F*B + 1], per-id weights,
    occurrences of each unique key per feature), on the ids' device.
    """
    for combiner in combiners:
        if combiner not in _COMBINER_CODES:
            raise ValueError(f"combiner={combiner!r} is not allowed; choose one of {COMBINERS}")
    parts = [_as_ids(f) for f in ids]
    batch = parts[0][2]
    for f, part in enumerate(parts):
        if part[2] != batch:
            raise ValueError(f"feature {f} has {part[2]} rows, feature 0 has {batch}")
    uniques, inverse, offsets, weights, counts = torch.ops.deeprec.prepare_bags(
        [p[0] for p in parts], [p[1] for p in parts], batch, [_COMBINER_CODES[c] for c in combiners],
        [0 if fill is None else int(fill) for fill in fill_ids], [fill is not None for fill in fill_ids])
    device = (ids[0][0] if isinstance(ids[0], tuple) else torch.as_tensor(ids[0])).device
    if device.type != "cpu":  # computed on a host copy (the stage runs on CPU by design)
        uniques, counts = [u.to(device) for u in uniques], [c.to(device) for c in counts]
        inverse, offsets, weights = inverse.to(device), offsets.to(device), weights.to(device)
    return tuple(uniques), inverse, offsets, weights, tuple(counts)


class RowGather(torch.autograd.Function):
    """rows = table[index]; backward sends (index, grad) to `sink` instead of
    producing a gradient for the table (the row-sparse optimizer applies it)."""

    @staticmethod
    def forward(ctx, token, table, index, sink):
        ctx.index, ctx.sink = index, sink
        return table.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(ctx.index, grad)
        return None, None, None, None


def pool_bags(rows: torch.Tensor, inverse, offsets, weights, batch: int, max_norm: float | None):
    """[F*B bags] -> [B, F, D] with optional max_norm clipping of each looked-up row."""
    if max_norm is not None:
        norms = rows.norm(dim=1, keepdim=True).clamp_min(1e-12)
        rows = rows * (max_norm / norms).clamp(max=1.0)
    if inverse.numel() == offsets.numel() - 1:  # one id in every bag: pooling is a gather
        pooled = rows.index_select(0, inverse)
    else:
        pooled = torch.nn.functional.embedding_bag(inverse, rows, offsets, mode="sum",
                                                   per_sample_weights=weights, include_last_offset=True)
    return pooled.view(-1, batch, rows.shape[1]).transpose(0, 1)
