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



def _as_bags(ids) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat values, lengths) of [B] ids, [B, L] padded ids, or a Ragged."""
    if isinstance(ids, Ragged) or (isinstance(ids, tuple) and len(ids) == 2):
        values, offsets = ids
        return values.reshape(-1).long(), (offsets[1:] - offsets[:-1]).long()
    ids = torch.as_tensor(ids)
    if ids.dim() == 1:
        ids = ids.unsqueeze(1)
    if ids.dim() != 2:
        raise ValueError(f"ids must be [B], [B, L] or Ragged(values, offsets), got shape {tuple(ids.shape)}")
    return ids.reshape(-1).long(), torch.full((ids.shape[0],), ids.shape[1], dtype=torch.long)


@op
def prepare_bags(ids: Sequence, combiners: Sequence[str], fill_ids: Sequence):
    """Prune negative ids, fill empty bags, dedup per feature, and lay out all
    F x B bags (feature-major) for one bag reduction.

    Returns (unique keys per feature, global inverse, offsets [F*B + 1], per-sample weights,
    occurrences of each unique key per feature).
    """
    uniques, inverses, lengths_all, weights, counts = [], [], [], [], []
    base = 0
    batch = None
    for f, (feature_ids, combiner, fill) in enumerate(zip(ids, combiners, fill_ids)):
        values, lengths = _as_bags(feature_ids)
        if batch is None:
            batch = lengths.numel()
        elif lengths.numel() != batch:
            raise ValueError(f"feature {f} has {lengths.numel()} rows, feature 0 has {batch}")
        bag_of = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        keep = values >= 0  # prune invalid ids
        values, bag_of = values[keep], bag_of[keep]
        lengths = torch.bincount(bag_of, minlength=lengths.numel())
        if fill is not None:  # an empty bag looks up the default id instead of yielding zeros
            empty = torch.nonzero(lengths == 0).squeeze(1)
            if empty.numel():
                values = torch.cat([values, torch.full((empty.numel(),), int(fill), dtype=values.dtype)])
                bag_of = torch.cat([bag_of, empty])
                order = torch.argsort(bag_of, stable=True)
                values, bag_of = values[order], bag_of[order]
                lengths = torch.bincount(bag_of, minlength=lengths.numel())
        unique, inverse, count = torch.unique(values, return_inverse=True, return_counts=True)
        uniques.append(unique)
        counts.append(count)
        inverses.append(inverse + base)
        base += unique.numel()
        lengths_all.append(lengths)
        n = lengths.clamp_min(1).to(torch.float32)[bag_of]
        if combiner == "sum":
            weights.append(torch.ones_like(n))
        elif combiner == "mean":
            weights.append(1.0 / n)
        elif combiner == "sqrtn":
            weights.append(n.rsqrt())
        else:
            raise ValueError(f"combiner={combiner!r} is not allowed; choose one of {COMBINERS}")
    lengths = torch.cat(lengths_all)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return tuple(uniques), torch.cat(inverses), offsets, torch.cat(weights), tuple(counts)


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
