"""Ops on ragged (multi-valued / sequence) columns, each one fx node.

A ragged column is `deeprec.Ragged(values, offsets)`: row b holds
values[offsets[b]:offsets[b + 1]]; values are int64 ids or a string column (a Ragged of bytes).

    hash_ragged(r, n)        values -> bucket ids in [0, n) (strings hashed, ints taken mod n)
    ragged_keys(r)           values -> 63-bit keys (strings hashed, ints kept): EmbeddingVariable ids
    truncate_ragged(r, L)    keep the last L items of each row (the most recent)
    pad_ragged(r, L, pad)    -> ids [B, L] (items left-aligned, oldest first) and mask [B, L]
"""
from __future__ import annotations

import torch

from deeprec.errors import ConfigError
from deeprec.ragged import Ragged
from deeprec.ops.graph_op import op


def _check(r) -> Ragged:
    if not (isinstance(r, tuple) and len(r) == 2):
        raise ConfigError(f"expected a Ragged(values, offsets) column, got {type(r).__name__}")
    return Ragged(*r)


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")


@op
def hash_ragged(r, num_buckets: int, hash: str = "siphash") -> Ragged:
    from deeprec.ops import string_to_hash_bucket

    r = _check(r)
    _positive("num_buckets", num_buckets)
    if isinstance(r.values, Ragged):  # a sequence of strings
        return Ragged(string_to_hash_bucket(r.values, num_buckets, hash), r.offsets)
    return Ragged(torch.remainder(r.values.long(), num_buckets), r.offsets)


@op
def ragged_keys(r, hash: str = "siphash") -> Ragged:
    from deeprec.ops import string_to_hash_key

    r = _check(r)
    if isinstance(r.values, Ragged):  # a sequence of strings
        return Ragged(string_to_hash_key(r.values, hash), r.offsets)
    return Ragged(r.values.long(), r.offsets)


def _kept(offsets: torch.Tensor, max_length: int):
    lengths = offsets[1:] - offsets[:-1]
    kept = lengths.clamp(max=max_length)
    row = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
    position = torch.arange(row.numel()) - (offsets[:-1] - offsets[0])[row]  # row.numel(): the items
    keep = position >= (lengths - kept)[row]
    return lengths, kept, row, keep


@op
def truncate_ragged(r, max_length: int) -> Ragged:
    r = _check(r)
    _positive("max_length", max_length)
    _, kept, _, keep = _kept(r.offsets, max_length)
    if isinstance(r.values, Ragged):
        raise ConfigError("truncate_ragged takes integer ids: hash string values first (hash_ragged)")
    values = r.values[keep]
    return Ragged(values, torch.cat([torch.zeros(1, dtype=torch.long), kept.cumsum(0)]))


@op(outputs=2)
def pad_ragged(r, max_length: int, pad_value: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ids [B, max_length] with the last max_length items of each row, oldest first,
    then `pad_value`; mask [B, max_length] is True on real items. Empty rows are all padding."""
    r = _check(r)
    _positive("max_length", max_length)
    if isinstance(r.values, Ragged):
        raise ConfigError("pad_ragged takes integer ids: hash string values first (hash_ragged)")
    lengths, kept, row, keep = _kept(r.offsets, max_length)
    batch = lengths.shape[0]
    ids = torch.full((batch, max_length), pad_value, dtype=torch.long)
    slot = (torch.arange(row.shape[0]) - (r.offsets[:-1] - r.offsets[0])[row]) - (lengths - kept)[row]
    ids[row[keep], slot[keep]] = r.values.long()[keep]
    mask = torch.arange(max_length).unsqueeze(0) < kept.unsqueeze(1)
    return ids, mask


@op
def id_to_bucket(ids: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Integer ids (-1 = missing) -> [0, num_buckets): missing maps to bucket 0."""
    _positive("num_buckets", num_buckets)
    return torch.where(ids < 0, torch.zeros_like(ids), torch.remainder(ids, num_buckets))


__all__ = ["hash_ragged", "ragged_keys", "truncate_ragged", "pad_ragged", "id_to_bucket"]
