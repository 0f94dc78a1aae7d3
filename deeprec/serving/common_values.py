"""A request of the common JSON values -> the raw batch in native passes, without Arrow.

Arrow's cost is per call as much as per value: about 15 us for each of a DLRM's 39 columns (an array, a
fill, a view), 0.45 ms for one row. Here the number columns become one float32 tensor and the string id
columns one buffer and one offsets tensor, each in one pass of the package's C++ (`deeprec._C.float_rows`,
`string_rows`, `int_rows`: deeprec/csrc/request_columns.cpp; Python per value cost 1.16 ms at 256 rows,
the native pass 0.18, Arrow 1.57), and each column's tensors are parts of them, made in C++ (a view made
from Python cost ~0.7 us, 52 for DLRM's string columns). Only the common JSON values take this path: numbers (floats, and ints that float32 holds exactly)
and nulls in a number column, ints and nulls in an int id column, strings, bytes, ints and nulls in a
string id column; numpy columns (KServe v2 binary tensors, gRPC) of floats in a number column, of ints
in an int id column, of objects in a string id column; a column absent. Anything else (numbers as text,
an inf, a bool, a sequence column) returns None, and the request takes `request.arrow_batch`, the
general path, which converts or names the bad value. Both give the same batch, bit for bit
(tests/test_common_values.py holds them equal on drawn values).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from deeprec import _C
from deeprec.data.schema import number_tensor, number_tensors
from deeprec.ragged import Ragged


class _Plan(NamedTuple):
    """A schema's columns by kind, sorted once: a request then walks names, not kinds."""
    order: tuple[str, ...]  # the batch's keys, in the schema's order (ignored columns left out)
    numbers: tuple  # label, dense, weight
    ints: tuple  # int id columns
    strings: tuple  # string id columns


def _plan(schema) -> _Plan | None:
    kept = [c for c in schema.columns if c.kind != "ignore"]
    if any(c.kind not in ("label", "dense", "weight", "categorical") for c in kept):
        return None  # a sequence: its separator, its ids' kind: the general path
    return _Plan(tuple(c.name for c in kept), tuple(c for c in kept if c.kind != "categorical"),
                 tuple(c for c in kept if c.kind == "categorical" and c.dtype == "int"),
                 tuple(c for c in kept if c.kind == "categorical" and c.dtype != "int"))


def common_batch(schema, rows: dict, n: int) -> dict | None:
    """The raw batch of `rows` (n rows, their shape checked by request_rows), or None: not all common values.
    The number columns sent as lists become one tensor, the string id columns one buffer and one offsets
    tensor, each column's tensors parts of them."""
    plan = schema.derived("common_values", _plan)
    if plan is None:
        return None
    batch = {}
    listed = []
    for c in plan.numbers:
        values = rows.get(c.name)
        if isinstance(values, list):
            listed.append((c, values))
            continue
        array = _floats(values, n, 0.0 if c.kind == "label" else np.nan)  # a label left out: 0
        if array is None:
            return None
        batch[c.name] = number_tensor(c, array)
    if listed:
        tensors = _C.float_rows([values for _, values in listed], n)  # one native pass, a part each
        if tensors is None:
            return None
        for (c, _), tensor in zip(listed, number_tensors([c for c, _ in listed], tensors)):
            batch[c.name] = tensor
    for c in plan.ints:
        column = _int_ids(rows.get(c.name), n)
        if column is None:
            return None
        batch[c.name] = column
    if plan.strings:
        columns = _string_columns([rows.get(c.name) for c in plan.strings], n)
        if columns is None:
            return None
        batch.update(zip([c.name for c in plan.strings], columns))
    return {name: batch[name] for name in plan.order}


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
    return _C.int_rows(values, n) if isinstance(values, list) else None


def _string_columns(columns: list, n: int) -> list[Ragged] | None:
    """String id columns (lists, numpy object arrays or None: absent, all b""): one buffer and one offsets
    array for all, each column's Ragged a view of them (None: a value not a string, bytes, int or null)."""
    lists = []
    for values in columns:
        if isinstance(values, np.ndarray):
            if values.dtype.kind != "O":
                return None
            values = values.tolist()
        lists.append(values)
    pairs = _C.string_rows(lists, n)
    return None if pairs is None else [Ragged(values, offsets) for values, offsets in pairs]
