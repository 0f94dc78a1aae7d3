"""Feature ops for use inside a model's `forward` (each is one fx node).

Raw batches carry categorical columns as numpy object arrays of `bytes`
(TensorFlow's string convention; `str` is accepted too and hashes the same as
its UTF-8 encoding) and dense columns as float32 tensors with NaN for missing.
"""
from __future__ import annotations

import numbers
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from deeprec.errors import ConfigError
from deeprec.ops.graph_op import is_op, is_stateful_op, op

__all__ = [
    "op", "is_op", "is_stateful_op", "string_to_hash_bucket", "hash64",
    "fill_missing", "log_normalize", "bucketize", "cross_hash_bucket", "dedup", "string_to_hash_key",
    "hash_ragged", "truncate_ragged", "pad_ragged", "id_to_bucket",
]


def _as_object_array(col) -> np.ndarray:
    if isinstance(col, np.ndarray) and col.dtype == object:
        return col
    if hasattr(col, "to_numpy") and not isinstance(col, (np.ndarray, torch.Tensor)):
        return np.asarray(col.to_numpy(zero_copy_only=False), dtype=object)  # pyarrow array
    return np.asarray(col, dtype=object)


_HASH_KEY = "0123456789123456"  # pandas' default key: part of the hash's definition

try:  # pandas' C kernel without hash_array's per-call dispatch (~25 us a column)
    from pandas._libs.hashing import hash_object_array as _siphash_objects
except ImportError:  # pragma: no cover - layout of a future pandas
    _siphash_objects = None


def _splitmix64_finalize(x: np.ndarray) -> np.ndarray:
    """In place: at 512 values per column, numpy's per-call cost dominates."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def hash64(col) -> np.ndarray:
    """Stable 64-bit hash of each string, equal to `pandas.util.hash_array(...,
    categorize=False)`: SipHash-2-4 with the fixed key b"0123456789123456"
    followed by the splitmix64 finalizer (tests/test_ops.py spells it out).

    The value depends only on the bytes of the string: the same on every run,
    process and machine. `str` values hash as their UTF-8 bytes.
    """
    values = _as_object_array(col)
    if _siphash_objects is None or values.ndim != 1:
        return pd.util.hash_array(values, categorize=False)
    with np.errstate(over="ignore"):
        return _splitmix64_finalize(_siphash_objects(values, _HASH_KEY, "utf8"))


@op
def string_to_hash_bucket(col, num_buckets: int) -> torch.Tensor:
    """Hash raw strings into [0, num_buckets): int64 tensor of shape [B].

    Same role as `tf.strings.to_hash_bucket_fast`; the hash is SipHash
    (see `hash64`), not TF's FarmHash, so bucket ids differ from TF's.
    """
    if not isinstance(num_buckets, numbers.Integral) or not 1 <= num_buckets <= 2**63:
        raise ConfigError(f"num_buckets must be an int in [1, 2**63], got {num_buckets!r}")
    buckets = hash64(col)
    np.remainder(buckets, np.uint64(num_buckets), out=buckets)
    return torch.from_numpy(buckets.view(np.int64))  # < num_buckets <= 2**63: same value


@op
def string_to_hash_key(col) -> torch.Tensor:
    """The 63-bit hash of each raw string as an int64 key (>= 0): ids for an
    EmbeddingVariable, which needs no bucket count and has no collisions."""
    return torch.from_numpy((hash64(col) >> np.uint64(1)).view(np.int64))


@op
def fill_missing(x: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """Replace NaN (a missing dense value) by `value`."""
    return torch.where(torch.isnan(x), torch.as_tensor(value, dtype=x.dtype), x)


@op
def log_normalize(x: torch.Tensor) -> torch.Tensor:
    """log(1 + max(x, 0)): the usual squashing of Criteo's heavy-tailed counts."""
    return torch.log1p(torch.clamp_min(x, 0.0))


@op
def bucketize(x: torch.Tensor, boundaries: Sequence[float]) -> torch.Tensor:
    """Bucket ids like `tf.raw_ops.Bucketize`: boundaries [a, b] map
    x < a -> 0, a <= x < b -> 1, x >= b -> 2. NaN maps to the last bucket;
    fill missing values first if that is not wanted."""
    bounds = torch.as_tensor(list(boundaries), dtype=x.dtype)
    if bounds.numel() > 1 and not bool((bounds[1:] > bounds[:-1]).all()):
        raise ConfigError(f"bucketize boundaries must be strictly increasing, got {list(boundaries)}")
    return torch.bucketize(x, bounds, right=True)


@op
def cross_hash_bucket(cols: Sequence, num_buckets: int, separator: str = "_X_") -> torch.Tensor:
    """Hash the crossed value of several raw string columns into [0, num_buckets):
    row i hashes cols[0][i] + separator + cols[1][i] + ... (a crossed_column feature)."""
    if len(cols) < 2:
        raise ConfigError(f"cross_hash_bucket needs at least 2 columns, got {len(cols)}")
    parts = [_as_object_array(c) for c in cols]
    as_str = len(parts[0]) > 0 and isinstance(parts[0][0], str)
    sep = np.array([separator if as_str else separator.encode()], dtype=object)
    crossed = parts[0]
    for part in parts[1:]:
        crossed = crossed + sep + part  # elementwise bytes concatenation
    return string_to_hash_bucket.__wrapped__(crossed, num_buckets)


@op
def dedup(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique ids, inverse) with unique[inverse] == ids: look up each id once."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    return unique, inverse


from deeprec.ops.sequence import hash_ragged, id_to_bucket, pad_ragged, truncate_ragged  # noqa: E402
