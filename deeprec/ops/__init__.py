"""Feature ops for use inside a model's `forward`: each is one graph node.

Raw batches carry string columns as `deeprec.Ragged` of bytes (Arrow's binary
layout: a uint8 values tensor and int64 offsets) and dense columns as float32
tensors with NaN for missing. The hashing, bucketizing and dedup kernels are
torch custom ops of the package's C++ extension (`torch.ops.deeprec.*`,
deeprec/csrc/feature_ops.cpp): they run without the GIL, so a SmartStage
thread overlaps the training step, and with their fake kernels
(`deeprec.ops.fake`) torch.compile and torch.export capture them as ops.

hash="siphash" (default): SipHash-2-4, key b"0123456789123456", then the
    splitmix64 finalizer; equal to `pandas.util.hash_array(categorize=False)`
    (deeprec's hash since 0.1: checkpoints keep their bucket ids).
hash="farmhash": FarmHash Fingerprint64, as TensorFlow's
    `tf.strings.to_hash_bucket_fast`: a model migrated from TF or DeepRec keeps its bucket ids.
"""
from __future__ import annotations

import numbers
from typing import Sequence

import torch

try:
    import deeprec._C  # noqa: F401  - registers torch.ops.deeprec.*
except ImportError as err:  # pragma: no cover - an install that skipped the C++ build
    raise ImportError("deeprec's C++ feature ops (deeprec/csrc) are not built for this torch: run `make setup`, "
                      "or `pip install --no-build-isolation -e .` in an environment that has torch") from err
from deeprec.errors import ConfigError, check_choice
from deeprec.ops import fake  # noqa: F401  - fake kernels for torch.compile / torch.export
from deeprec.ops import step  # noqa: F401  - the step ops' autograd formulas
from deeprec.ops.graph_op import is_op, is_pure_op, is_stateful_op, op
from deeprec.ragged import Ragged

__all__ = [
    "op", "is_op", "is_pure_op", "is_stateful_op", "HASHES", "string_to_hash_bucket", "string_to_hash_key",
    "fill_missing", "log_normalize", "bucketize", "cross_hash_bucket", "dedup",
    "hash_ragged", "ragged_keys", "truncate_ragged", "pad_ragged", "id_to_bucket",
]

HASHES = ("siphash", "farmhash")


def _strings(col, what: str) -> Ragged:
    if isinstance(col, Ragged) and col.is_strings:
        return col
    if isinstance(col, tuple) and len(col) == 2 and isinstance(col[0], torch.Tensor) and col[0].dtype == torch.uint8:
        return Ragged(*col)
    raise ConfigError(f"{what} takes a string column: a deeprec.Ragged of bytes (uint8 values, int64 offsets), "
                      f"as readers yield; got {type(col).__name__}. Build one with dr.Ragged.from_strings([...])")


def _columns(cols, what: str) -> tuple[list[Ragged], bool]:
    """(string columns, whether one column was given rather than a list)."""
    if isinstance(cols, (list, tuple)) and not isinstance(cols, Ragged) and \
            not (len(cols) == 2 and isinstance(cols[0], torch.Tensor)):
        return [_strings(c, what) for c in cols], False
    return [_strings(cols, what)], True


def _count_columns(cols, *args, **kwargs) -> int | None:
    """How many tensors a hash op returns for `cols`: one per column of a list, None for one column."""
    if isinstance(cols, (list, tuple)) and not isinstance(cols, Ragged) and \
            not (len(cols) == 2 and isinstance(cols[0], torch.Tensor)):
        return len(cols)
    return None


def _num_buckets(value, count: int) -> list[int]:
    values = [value] * count if isinstance(value, numbers.Integral) else list(value)
    if len(values) != count:
        raise ConfigError(f"num_buckets has {len(values)} entries for {count} columns")
    for n in values:
        if not isinstance(n, numbers.Integral) or not 1 <= n <= 2**63 - 1:
            raise ConfigError(f"num_buckets must be an int in [1, 2**63 - 1], got {n!r}")
    return [int(n) for n in values]


@op(outputs=_count_columns, pure=True)
def string_to_hash_bucket(col, num_buckets, hash: str = "siphash"):
    """Hash each string into [0, num_buckets): int64 [B] (the role of `tf.strings.to_hash_bucket_fast`).

    `col` may be a list of string columns (one op call for all of them; `num_buckets`
    an int or one per column): returns a tuple of tensors, one per column.
    """
    check_choice("hash", hash, HASHES)
    cols, single = _columns(col, "string_to_hash_bucket")
    out = torch.ops.deeprec.string_to_hash_bucket([c.values for c in cols], [c.offsets for c in cols],
                                                  _num_buckets(num_buckets, len(cols)), hash)
    return out[0] if single else tuple(out)


@op(outputs=_count_columns, pure=True)
def string_to_hash_key(col, hash: str = "siphash"):
    """The 63-bit hash of each string as an int64 key (>= 0): ids for an EmbeddingVariable,
    which needs no bucket count. A list of columns gives a tuple of tensors, one per column."""
    check_choice("hash", hash, HASHES)
    cols, single = _columns(col, "string_to_hash_key")
    out = torch.ops.deeprec.string_to_hash_key([c.values for c in cols], [c.offsets for c in cols], hash)
    return out[0] if single else tuple(out)


@op(pure=True)
def cross_hash_bucket(cols: Sequence, num_buckets: int, separator: str = "_X_", hash: str = "siphash") -> torch.Tensor:
    """Hash the crossed value of several string columns into [0, num_buckets):
    row i hashes cols[0][i] + separator + cols[1][i] + ... (a crossed_column feature)."""
    check_choice("hash", hash, HASHES)
    parts, _ = _columns(cols, "cross_hash_bucket")
    if len(parts) < 2:
        raise ConfigError(f"cross_hash_bucket needs at least 2 columns, got {len(parts)}")
    return torch.ops.deeprec.cross_hash_bucket([c.values for c in parts], [c.offsets for c in parts],
                                               _num_buckets(num_buckets, 1)[0], separator, hash)


@op(pure=True)
def fill_missing(x: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """Replace NaN (a missing dense value) by `value`."""
    return torch.nan_to_num(x, nan=value, posinf=float("inf"), neginf=float("-inf"))


@op(pure=True)
def log_normalize(x: torch.Tensor) -> torch.Tensor:
    """log(1 + max(x, 0)): the usual squashing of Criteo's heavy-tailed counts."""
    return torch.log1p(torch.clamp_min(x, 0.0))


@op(pure=True)
def bucketize(x: torch.Tensor, boundaries: Sequence[float]) -> torch.Tensor:
    """Bucket ids like `tf.raw_ops.Bucketize`: boundaries [a, b] map
    x < a -> 0, a <= x < b -> 1, x >= b -> 2 (boundaries in x's dtype). NaN maps to
    the last bucket; fill missing values first if that is not wanted."""
    bounds = boundaries if isinstance(boundaries, torch.Tensor) else torch.tensor(list(boundaries), dtype=x.dtype)
    return torch.ops.deeprec.bucketize(x, bounds.to(x.dtype))


@op(outputs=2, pure=True)
def dedup(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted unique ids, inverse) with unique[inverse] == ids: look up each id once."""
    return torch.ops.deeprec.dedup(ids)


from deeprec.ops.sequence import hash_ragged, id_to_bucket, pad_ragged, ragged_keys, truncate_ragged  # noqa: E402
