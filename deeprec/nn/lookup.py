"""Bag preparation and the fused row gather behind `EmbeddingCollection`.

    ids of F features ──prepare_bags (pure: SmartStage can run it ahead)──>
        per-feature unique keys, global inverse, bag offsets, combiner weights
    ──RowGather (one gather; its backward hands the unique rows' gradient to a
      row-sparse optimizer, fused)──> rows [U, D]
    ──max_norm, embedding_bag(sum, per-sample weights)──> [B, F, D] pooled features
                ──per-position gather (padding -> a zero row)──> [B, L, D] sequence features

Combiners are per-sample weights of one "sum" bag reduction: sum -> 1,
mean -> 1/n, sqrtn -> 1/sqrt(n); autograd differentiates them (so sqrtn's
backward is the true gradient of the unfused formula).

`EmbeddingLookup` is the interface every lookup module declares (FusedLookup, a free
EmbeddingVariable, the PS's RemoteLookup, the collective ShardedLookup): graph passes and
runtimes ask it what they need, never the concrete class.
"""
from __future__ import annotations

import abc
from typing import Sequence

import torch
from torch import nn

from deeprec.ops.graph_op import op
from deeprec.ops.step import gather_rows

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


@op(outputs=5, pure=True)
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
    flat = torch.ops.deeprec.prepare_bags(  # one flat list: [uniques (F)..., inverse, offsets, weights, counts (F)...]
        [p[0] for p in parts], [p[1] for p in parts], batch, [_COMBINER_CODES[c] for c in combiners],
        [0 if fill is None else int(fill) for fill in fill_ids], [fill is not None for fill in fill_ids])
    features = len(parts)
    uniques, counts = flat[:features], flat[features + 3:]
    inverse, offsets, weights = flat[features:features + 3]
    device = (ids[0][0] if isinstance(ids[0], tuple) else torch.as_tensor(ids[0])).device
    if device.type != "cpu":  # computed on a host copy (the stage runs on CPU by design)
        uniques, counts = [u.to(device) for u in uniques], [c.to(device) for c in counts]
        inverse, offsets, weights = inverse.to(device), offsets.to(device), weights.to(device)
    return tuple(uniques), inverse, offsets, weights, tuple(counts)


def merge_rows(rows: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique rows with the gradients of duplicates summed."""
    unique, inverse = torch.unique(rows, return_inverse=True)
    if unique.numel() == rows.numel():
        order = torch.empty_like(inverse)
        order[inverse] = torch.arange(rows.numel(), device=rows.device)
        return unique, grads[order]
    summed = torch.zeros(unique.numel(), *grads.shape[1:], dtype=grads.dtype, device=grads.device)
    summed.index_add_(0, inverse, grads)
    return unique, summed


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


@op(outputs=3)
def merge_shared_tables(uniques: Sequence[torch.Tensor], inverse: torch.Tensor, counts: Sequence[torch.Tensor],
                        table_of: Sequence[int]):
    """Per-feature unique keys -> per-table unique keys, for features that share a table
    (a behaviour sequence embedded with its item column): a row is gathered once and its
    gradients summed into one update. `inverse` is remapped onto the tables' rows."""
    num_tables = max(table_of) + 1
    table_keys, table_counts, local = [], [], [None] * len(uniques)
    for t in range(num_tables):
        members = [f for f, owner in enumerate(table_of) if owner == t]
        if len(members) == 1:
            f = members[0]
            table_keys.append(uniques[f])
            table_counts.append(counts[f])
            local[f] = torch.arange(uniques[f].numel(), device=inverse.device)
            continue
        keys, where = torch.unique(torch.cat([uniques[f] for f in members]), return_inverse=True)
        table_keys.append(keys)
        table_counts.append(torch.zeros(keys.numel(), dtype=torch.long, device=keys.device)
                            .index_add_(0, where, torch.cat([counts[f] for f in members]).long()))
        for f, part in zip(members, where.split([uniques[f].numel() for f in members])):
            local[f] = part
    starts = [0]
    for keys in table_keys:
        starts.append(starts[-1] + keys.numel())
    row_of = torch.cat([local[f] + starts[t] for f, t in enumerate(table_of)])
    return tuple(table_keys), row_of[inverse], tuple(table_counts)


_COUNTING = torch.arange(0, dtype=torch.long, device="cpu")


def _counting(n: int) -> torch.Tensor:
    """arange(n) as int64, from one kept tensor (grown as needed; a replaced one stays valid)."""
    global _COUNTING
    counting = _COUNTING
    if counting.numel() < n:
        counting = _COUNTING = torch.arange(max(n, 2 * counting.numel()), dtype=torch.long, device="cpu")
    return counting[:n]


def _position(offsets: torch.Tensor, i, limit) -> int:
    """offsets[i] as a Python int, declared a valid slice bound (torch.export traces it as a symbol)."""
    value = offsets[i].item()
    torch._check(value >= 0)
    torch._check(value <= limit)
    return value


def assemble(rows: torch.Tensor, inverse, offsets, weights, masks: Sequence[torch.Tensor], num_pooled: int,
             max_norm: float | None):
    """Looked-up rows [U, D] -> the pooled features' [B, P, D] (the first P features' bags) and
    each sequence feature's [B, L, D] (its valid positions, in order; padding reads a zero row).
    Bags are feature-major: feature f's bags are offsets[f*B : (f+1)*B + 1]."""
    num_features = num_pooled + len(masks)
    batch = (offsets.numel() - 1) // num_features
    if max_norm is not None:
        norms = rows.norm(dim=1, keepdim=True).clamp_min(1e-12)
        rows = rows * (max_norm / norms).clamp(max=1.0)
    dim = rows.shape[1]
    end = num_pooled * batch
    if num_pooled == 0:
        pooled = rows.new_zeros(batch, 0, dim)
    else:
        ids_end = _position(offsets, end, inverse.numel()) if masks else inverse.numel()
        bag_inverse, bag_offsets = inverse[:ids_end], offsets[:end + 1]
        # one id in every bag: pooling is a gather (the same values as embedding_bag's weighted sum of
        # one row; an exported program, whose sizes are symbols, takes the general path). As many ids as
        # bags is not enough (a bag of two and an empty one): every bag's length is checked too, in eager
        # and on the CPU only (on a GPU the check would wait for the device on every forward)
        one_each = bag_inverse.numel() == end
        if not isinstance(one_each, bool):  # a SymBool while tracing (sympy: imported only then)
            from torch.fx.experimental.symbolic_shapes import guard_or_false

            one_each = guard_or_false(one_each)
        one_each = one_each and not torch.compiler.is_compiling() and bag_offsets.device.type == "cpu"
        if one_each and bag_offsets.numel() > 1:  # offsets 0, 1, ..., end: one comparison
            one_each = torch.equal(bag_offsets, _counting(bag_offsets.numel()))
        if one_each:  # its backward reads the gradient in the [B, P, D] layout it arrives in (no copy)
            pooled = gather_rows(rows, bag_inverse.view(num_pooled, batch)).transpose(0, 1)
        else:
            flat = torch.nn.functional.embedding_bag(bag_inverse, rows, bag_offsets, mode="sum",
                                                     per_sample_weights=weights[:ids_end], include_last_offset=True)
            pooled = flat.view(num_pooled, batch, dim).transpose(0, 1)
    if not masks:
        return pooled
    padded = torch.cat([rows, rows.new_zeros(1, dim)])  # row U: what padding reads
    sequences = []
    for s, mask in enumerate(masks):
        f = num_pooled + s
        start, stop = _position(offsets, f * batch, inverse.numel()), _position(offsets, (f + 1) * batch, inverse.numel())
        index = torch.full((mask.numel(),), rows.shape[0], dtype=torch.long, device=rows.device)
        index[mask.reshape(-1)] = inverse[start:stop]
        sequences.append(padded.index_select(0, index).view(*mask.shape, dim))
    return pooled, tuple(sequences)


class EmbeddingLookup(abc.ABC, nn.Module):
    """An embedding lookup module, as graph passes and runtimes see it (declared the way TorchRec
    declares `EmbeddingBagCollectionInterface`). Every lookup deeprec offers implements it:
    `FusedLookup` (an EmbeddingCollection's tables), `EmbeddingVariable` (`ev(ids)`),
    `RemoteLookup`/`RemoteVariable` (rows on parameter servers), `ShardedLookup` (rows over ranks).

        capture          one graph node (never traced into)
        SmartStage       never staged while `stateful` (its inputs' hashing is)
        MultiStream      "embedding" policy: a stream per lookup
        micro-batching   `updates_in_backward` ones `defer_updates(True)` over the micro-batches;
                         the optimizer step calls `apply_pending()` (rows merged, one update)
        prefetch         `can_prefetch`: the stage hands it the next batch's keys (`prefetch`)
        placement        `holds_tables`, `hash_tables`, `table_nbytes()`, `table_device`
        explain()        lines for `OptimizedModel.explain()`
    """

    @abc.abstractmethod
    def forward(self, *args):
        """Keys in, rows (pooled or per id) out."""

    # -- graph passes -------------------------------------------------------------------------
    @property
    def stateful(self) -> bool:
        """It inserts keys and its rows change with every update: running it ahead of the step
        (SmartStage) would read stale rows."""
        return True

    def explain(self) -> list[str]:
        return []

    # -- updates ------------------------------------------------------------------------------
    def set_optimizer(self, optimizer) -> None:
        """Attach the row-sparse optimizer (deeprec.optim.row_sparse_optimizer) its updates apply
        (deeprec.optim.make_optimizer attaches one to every lookup of a model)."""
        raise NotImplementedError(f"{type(self).__name__} updates its rows elsewhere (parameter servers)")

    @property
    @abc.abstractmethod
    def updates_in_backward(self) -> bool:
        """Its backward applies a row-sparse optimizer to the rows right away (micro-batching must
        `defer_updates` so that every micro-batch reads the step's rows)."""

    def defer_updates(self, defer: bool) -> None:
        """True: backward keeps the rows' gradients for `apply_pending()`; False: it updates again."""
        if defer:
            raise NotImplementedError(f"{type(self).__name__} cannot keep its updates for the optimizer step")

    @property
    def has_pending(self) -> bool:
        """Row gradients are kept, waiting for `apply_pending()`."""
        return False

    def apply_pending(self) -> None:
        """Apply the kept row gradients (rows seen in several backwards merged): one optimizer step."""

    def discard_pending(self) -> None:
        """Drop the kept row gradients (a step that is not applied)."""

    def check_applied(self) -> None:
        """Raise if gradients kept for the last step were never applied (a lookup must not read them stale)."""
        if self.has_pending:
            raise RuntimeError(f"{type(self).__name__}: embedding gradients kept over the last step's micro-batches "
                               "were never applied: step the optimizer of deeprec.optim.make_optimizer (or call "
                               "apply_pending()) after each micro-batched step")

    @property
    def must_run_backward(self) -> bool:
        """Its backward pairs up with other processes' (collective all-to-all): never skip it."""
        return False

    # -- prefetch -----------------------------------------------------------------------------
    @property
    def can_prefetch(self) -> bool:
        """`prefetch(keys)` prepares the rows of staged keys ahead of the step."""
        return False

    @property
    def prefetch_reads_rows(self) -> bool:
        """`prefetch` reads the rows' values, which may then miss the current step's update (the
        PS's async embedding: bounded staleness, opt-in); False: it only moves rows, values exact."""
        return False

    def prefetch(self, keys, train: bool) -> None:
        """Prepare the rows of `keys` (the lookup's first input, as the stage computed it)."""
        raise NotImplementedError(f"{type(self).__name__} does not prefetch")

    def discard_prefetched(self) -> None:
        """Forget rows prefetched for batches that will not be trained on."""

    # -- placement ----------------------------------------------------------------------------
    @property
    def holds_tables(self) -> bool:
        """The rows live in this process (False: on parameter servers)."""
        return True

    @property
    def hash_tables(self) -> bool:
        """The tables are hash tables (EmbeddingVariables): they grow, and stay in host memory."""
        return True

    def table_nbytes(self) -> int:
        """Bytes of the fixed-size tables and their optimizer slots (hash tables grow: 0)."""
        return 0

    @property
    def table_device(self) -> torch.device:
        return torch.device("cpu")


def embedding_lookups(model: nn.Module) -> list[tuple[str, EmbeddingLookup]]:
    """(name, lookup) of every embedding lookup of `model`, each once (a shared one under its first
    name), outermost only: the EmbeddingVariables inside a FusedLookup are its tables, not lookups."""
    found: list[tuple[str, EmbeddingLookup]] = []
    for name, module in model.named_modules():
        if isinstance(module, EmbeddingLookup) and not any(name.startswith(f"{outer}.") or outer == ""
                                                           for outer, _ in found):
            found.append((name, module))
    return found
