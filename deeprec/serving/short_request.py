"""A short request's columns -> the raw batch in plain Python and numpy, without Arrow.

On a request of a few rows Arrow's cost is per call, not per value: about 15 us for each of a DLRM's 39
columns (an array, a fill, a view), 0.45 ms in all for one row. Here each column is one pass over its
few values, and the columns of a kind share one array (numbers) or one buffer and one offsets array
(string ids): a tensor per column cost ~5 us. Only the common JSON values take this path: numbers
(floats, and ints that float32 holds exactly) and nulls in a number column, ints and nulls in an int
id column, strings, bytes, ints and nulls in a string id column; numpy columns (KServe v2 binary
tensors, gRPC) of floats in a number column, of ints in an int id column, of objects in a string id
column; a column absent. Anything else (numbers as text, an inf, a bool, a sequence column) returns
None, and the request takes `request.arrow_batch`, the general path, which converts or names the bad
value. Both give the same batch, bit for bit (tests/test_short_request.py holds them equal on drawn
values).
"""
from __future__ import annotations

import numpy as np
import torch

from deeprec.data.schema import number_tensor, number_tensors
from deeprec.ragged import Ragged

SHORT_ROWS = 128  # up to here the Python pass costs less than Arrow (DLRM: 64 rows 0.31 vs 0.68 ms, 128 rows
# 0.53 vs 0.84, 256 rows 1.08 vs 0.98)
_EXACT = 1 << 24  # ints up to this convert to float32 exactly, whichever way they go


def short_batch(schema, rows: dict, n: int) -> dict | None:
    """The raw batch of `rows` (n rows, their shape checked by request_rows), or None: not all common values.
    The number columns sent as lists become one array, the string id columns one buffer and one offsets
    array, each column a view of them (DLRM, 1 row: 0.24 -> 0.11 ms; a tensor per column cost ~5 us)."""
    batch, floats, strings = {}, [], []
    for c in schema.columns:
        if c.kind == "ignore":
            continue
        values = rows.get(c.name)
        if c.kind in ("label", "dense", "weight"):
            if isinstance(values, list):
                floats.append((c, values))
                batch[c.name] = None  # filled below, in the columns' order
                continue
            array = _floats(values, n, 0.0 if c.kind == "label" else np.nan)  # a label left out: 0
            if array is None:
                return None
            batch[c.name] = number_tensor(c, array)
        elif c.kind == "categorical" and c.dtype == "int":
            column = _int_ids(values, n)
            if column is None:
                return None
            batch[c.name] = column
        elif c.kind == "categorical":
            strings.append((c, values))
            batch[c.name] = None
        else:  # a sequence: its separator, its ids' kind: the general path
            return None
    if floats:
        arrays = _float_rows([values for _, values in floats], n)
        if arrays is None:
            return None
        for (c, _), tensor in zip(floats, number_tensors([c for c, _ in floats], arrays)):
            batch[c.name] = tensor
    if strings:
        columns = _string_columns([values for _, values in strings], n)
        if columns is None:
            return None
        for (c, _), column in zip(strings, columns):
            batch[c.name] = column
    return batch


def _float_rows(columns: list[list], n: int) -> np.ndarray | None:
    """Number columns sent as lists: one float32 array [columns, n] (None: a value not a plain number)."""
    flat = []
    for values in columns:
        for v in values:
            t = type(v)
            if not (t is float or v is None or t is int and -_EXACT <= v <= _EXACT):
                return None
        flat += values
    with np.errstate(over="ignore"):  # beyond float32: inf, refused below
        array = np.array([np.nan if v is None else v for v in flat], np.float32)
    return None if np.isinf(array).any() else array.reshape(len(columns), n)


def _floats(values, n: int, absent: float) -> np.ndarray | None:
    """A number column left out (all `absent`) or sent as a numpy array (KServe v2 binary, gRPC)."""
    if values is None:
        return np.full(n, absent, np.float32)
    if not isinstance(values, np.ndarray) or values.dtype.kind != "f":
        return None
    with np.errstate(over="ignore"):
        array = values.astype(np.float32)
    return None if np.isinf(array).any() else array  # inf, or beyond float32: refused by the general path


def _int_ids(values, n: int) -> torch.Tensor | None:
    if values is None:
        return torch.full((n,), -1, dtype=torch.int64)
    if isinstance(values, np.ndarray):
        return torch.from_numpy(values.astype(np.int64)) if values.dtype.kind == "i" else None
    for v in values:
        if not (v is None or type(v) is int and -(1 << 63) <= v < (1 << 63)):
            return None
    return torch.tensor([-1 if v is None else v for v in values], dtype=torch.int64)


def _string_columns(columns: list, n: int) -> list[Ragged] | None:
    """String id columns (lists, numpy object arrays or None: absent, all b""): one buffer and one offsets
    array for all, each column's Ragged a view of them (None: a value not a string, bytes, int or null)."""
    parts = []
    try:
        for values in columns:
            if values is None:
                parts += [b""] * n
                continue
            if isinstance(values, np.ndarray):
                if values.dtype.kind != "O":
                    return None
                values = values.tolist()
            for v in values:
                t = type(v)
                if t is str:
                    parts.append(v.encode())
                elif v is None:
                    parts.append(b"")
                elif t is bytes:
                    parts.append(v)
                elif t is int:
                    parts.append(str(v).encode())
                else:
                    return None
    except UnicodeEncodeError:  # a lone surrogate: named by the general path
        return None
    joined = b"".join(parts)
    offsets = np.zeros((len(columns), n + 1), np.int64)
    np.cumsum(np.fromiter(map(len, parts), np.int64, len(parts)).reshape(len(columns), n), axis=1, out=offsets[:, 1:])
    data = torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
    return [Ragged(values, ends) for values, ends in zip(data.split(offsets[:, -1].tolist()),
                                                         torch.from_numpy(offsets).unbind(0))]
