"""Auto Micro Batch: one batch, N forward/backward passes, one optimizer step.

    batch ──split dim 0──> mb_1 ... mb_N ──(stage of mb_k+1 runs while mb_k computes)──>
        forward(mb_k); backward(loss_k * n_k / B)   # .grad accumulates the full-batch gradient
    caller: optimizer.step()

For a loss that is a mean over rows, sum_k (n_k / B) * grad(loss_k) is exactly the
full-batch gradient, also for an uneven split (sizes differ by at most one row,
like numpy.array_split). Embedding rows of every lookup that updates them in
backward (`EmbeddingLookup.updates_in_backward`: an EmbeddingCollection, a free
EmbeddingVariable, a collective ShardedLookup) are kept until the optimizer step,
rows seen in several micro-batches merged, then one row-sparse update. The reader is wrapped, never copied: each batch is read once.
"""
from __future__ import annotations

import collections

import numpy as np
import torch

from deeprec.errors import ConfigError
from deeprec.nn.lookup import EmbeddingLookup, embedding_lookups
from deeprec.data.collate import batch_rows
from deeprec.ragged import Ragged


def split_sizes(total: int, n: int) -> list[int]:
    if total < n:
        raise ConfigError(f"micro_batch_num={n} is larger than the batch ({total} rows)")
    base, extra = divmod(total, n)
    return [base + 1 if k < extra else base for k in range(n)]


def split_batch(batch, n: int) -> list:
    """`n` micro-batches of a dict (or tuple) of tensors and Raggeds, split along dim 0."""
    total = batch_rows(batch)
    sizes = split_sizes(total, n)
    bounds = np.cumsum([0, *sizes])

    def part(value, k):
        if isinstance(value, Ragged):  # rows [a, b): their values, offsets rebased to 0
            a, b = int(bounds[k]), int(bounds[k + 1])
            if len(value.offsets) - 1 != total:
                raise ConfigError(f"cannot split the batch: a sequence column has {len(value.offsets) - 1} rows, "
                                  f"another column {total}")
            return value.slice_rows(a, b)
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            if value.shape[0] != total:
                raise ConfigError(f"cannot split the batch: a column has {value.shape[0]} rows, another {total}")
            return value[bounds[k]:bounds[k + 1]]
        if isinstance(value, dict):
            return {key: part(v, k) for key, v in value.items()}
        return value  # scalars and other per-batch values are shared

    if isinstance(batch, dict):
        return [{key: part(v, k) for key, v in batch.items()} for k in range(n)]
    return [type(batch)(part(v, k) for v in batch) for k in range(n)]


class MicroBatchSource:
    """Wraps a reader: yields the micro-batches of each batch, and records each
    batch's sizes for the consumer (the prefetch keeps the order)."""

    def __init__(self, reader, n: int):
        self.reader, self.n = reader, n
        self.sizes: collections.deque = collections.deque()
        self._parts: collections.deque = collections.deque()
        self._it = None

    def __iter__(self):
        self._it = iter(self.reader)
        return self

    def __next__(self):
        if not self._parts:
            batch = next(self._it)
            parts = split_batch(batch, self.n)
            self.sizes.append([batch_rows(p) for p in parts])
            self._parts.extend(parts)
        return self._parts.popleft()

    def state_dict(self):  # the reader's position after the whole batch
        return self.reader.state_dict()


def combine_outputs(outputs: list[dict], sizes: list[int]) -> dict:
    """Rows concatenated; scalars (the loss) averaged, weighted by micro-batch size."""
    if len(outputs) == 1:  # one batch: its outputs, detached (no copy, no arithmetic)
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in outputs[0].items()}
    total = sum(sizes)
    combined = {}
    for key, first in outputs[0].items():
        values = [o[key] for o in outputs]
        if isinstance(first, torch.Tensor) and first.dim() == 0:
            combined[key] = sum(v.detach() * (n / total) for v, n in zip(values, sizes))
        elif isinstance(first, torch.Tensor):
            combined[key] = torch.cat([v.detach() for v in values])
        else:
            combined[key] = values[-1]
    return combined


def deferred_lookups(model: torch.nn.Module) -> list[EmbeddingLookup]:
    """The embedding lookups whose row-sparse update runs inside backward: micro-batching defers them."""
    return [m for _, m in embedding_lookups(model) if m.updates_in_backward]
