"""A request of the common values takes a native path without Arrow (serving/common_values.py): the same
batch, bit for bit, as the general path, or None where a value is not one of the common kinds."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deeprec.data.schema import Column, Schema
from deeprec.ragged import Ragged
from deeprec.serving.common_values import common_batch
from deeprec.serving.request import RequestError, arrow_batch, request_batch

SCHEMA = Schema((Column("label", "label"), Column("score", "label", positive_at=4.0), Column("w", "weight"),
                 Column("I1", "dense"), Column("I2", "dense"), Column("id", "categorical", dtype="int"),
                 Column("C1", "categorical"), Column("C2", "categorical"), Column("skip", "ignore")))

numbers = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False),
                    st.integers(-(1 << 25), 1 << 25), st.sampled_from([0, 1, -1, 0.5, 1e39, -0.0, True]),
                    st.sampled_from(["3", " 2.5", "NA", "x"]))
int_ids = st.one_of(st.none(), st.integers(-(1 << 64), 1 << 64), st.integers(-5, 5), st.sampled_from([17.0, "17", True]))
string_ids = st.one_of(st.none(), st.text(max_size=6), st.integers(-(1 << 40), 1 << 40), st.sampled_from(
    ["", "68fd1e64", "\ud800", 2.5, False]))


def _equal(a, b) -> bool:
    if isinstance(a, Ragged):
        return isinstance(b, Ragged) and torch.equal(a.values, b.values) and torch.equal(a.offsets, b.offsets)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and \
        torch.equal(a.isnan(), b.isnan())


def _same_batches(native: dict, general: dict) -> None:
    assert list(native) == list(general)
    for name in general:
        assert _equal(native[name], general[name]), (name, native[name], general[name])


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4).flatmap(lambda n: st.fixed_dictionaries(
    {}, optional={"label": st.lists(numbers, min_size=n, max_size=n), "score": st.lists(numbers, min_size=n, max_size=n),
                  "w": st.lists(numbers, min_size=n, max_size=n), "I1": st.lists(numbers, min_size=n, max_size=n),
                  "I2": st.lists(numbers, min_size=n, max_size=n), "id": st.lists(int_ids, min_size=n, max_size=n),
                  "C1": st.lists(string_ids, min_size=n, max_size=n), "C2": st.lists(string_ids, min_size=n, max_size=n)}
)).filter(bool))
def test_a_request_of_common_values_converts_as_the_general_path(rows):
    n = len(next(iter(rows.values())))
    native = common_batch(SCHEMA, rows, n)
    try:
        general = arrow_batch(SCHEMA, rows, n)
    except RequestError:
        assert native is None  # a bad value is left to the general path, which names it
        return
    if native is not None:
        _same_batches(native, general)


def test_common_values_take_the_native_path_and_numpy_columns_too():
    rows = {"label": [1.0, 0.0], "w": [None, 2.0], "I1": [3, None], "I2": [0.1, float("nan")], "id": [17, None],
            "C1": ["68fd1e64", None], "C2": [12, ""]}
    native = common_batch(SCHEMA, rows, 2)
    assert native is not None
    _same_batches(native, arrow_batch(SCHEMA, rows, 2))
    assert native["score"].tolist() == [0.0, 0.0] and native["w"].tolist() == [1.0, 2.0]
    assert math.isnan(native["I1"][1]) and native["id"].tolist() == [17, -1]
    arrays = {"I1": np.array([1.5, np.nan]), "id": np.array([3, 4]), "C1": np.array([b"a", "\u00e9"], dtype=object)}
    native = common_batch(SCHEMA, arrays, 2)
    assert native is not None
    _same_batches(native, arrow_batch(SCHEMA, arrays, 2))
    assert torch.equal(request_batch(SCHEMA, rows)["C1"].values, common_batch(SCHEMA, rows, 2)["C1"].values)


def test_values_the_native_path_leaves_to_the_general_one():
    for rows in ({"I1": ["3"]}, {"I1": [True]}, {"I1": [float("inf")]}, {"I1": [1 << 30]}, {"id": [17.0]},
                 {"C1": [2.5]}, {"C1": ["\ud800"]}, {"I1": np.array([1, 2])}):
        assert common_batch(SCHEMA, rows, len(next(iter(rows.values())))) is None, rows


def test_a_large_request_of_common_values_converts_as_the_general_path():
    rng = np.random.default_rng(0)  # every row count takes the native path: 1,000 rows, some values missing
    n = 1000
    rows = {"label": rng.integers(0, 2, n).tolist(), "I1": [None if k % 7 == 0 else float(v) for k, v in
                                                           enumerate(rng.normal(size=n))],
            "I2": rng.integers(-100, 100, n).tolist(), "id": [None if k % 5 == 0 else int(v) for k, v in
                                                            enumerate(rng.integers(-(1 << 62), 1 << 62, n))],
            "C1": [None if k % 3 == 0 else f"{v:08x}" for k, v in enumerate(rng.integers(0, 1 << 32, n))],
            "C2": [int(v) if k % 2 else "\u00e9t\u00e9" for k, v in enumerate(rng.integers(0, 1 << 40, n))]}
    native = common_batch(SCHEMA, rows, n)
    assert native is not None
    _same_batches(native, arrow_batch(SCHEMA, rows, n))
    assert common_batch(SCHEMA, {**rows, "C1": rows["C1"][:-1] + [2.5]}, n) is None  # one odd value, the last


def test_bytes_elements_split_as_triton_lays_them_out():
    from deeprec import _C

    elements = [b"", b"68fd1e64", bytes(range(256)) * 300, "\u00e9".encode()]  # a length over 2**16 too
    body = b"".join(len(e).to_bytes(4, "little") + e for e in elements)
    framed = memoryview(b"xx" + body + b"yy")[2:-2]  # a slice of a larger body, as a request's binary part
    assert _C.bytes_elements(framed, 4) == elements
    assert _C.bytes_elements(b"", 0) == []
    assert _C.bytes_elements(body[:-1], 4) == (3, len(body) - 6)  # element 3 (from there) ends past the data
    assert _C.bytes_elements(body[:2], 4) == (0, 0)  # a length cut short
    assert _C.bytes_elements(body + b"z", 4) == (4, len(body))  # a byte left after the last element
    assert _C.bytes_elements(body, 3) == (3, len(body) - 6)
    assert _C.bytes_elements(b"", 1 << 61) == (0, 0)  # a count the client claims allocates nothing first


def test_native_conversions_refuse_negative_sizes_with_an_exception_not_an_abort():
    from deeprec import _C

    for call in (lambda: _C.float_rows([], -1), lambda: _C.int_rows([], -1), lambda: _C.string_rows([], -2),
                 lambda: _C.bytes_elements(b"", -1)):
        with pytest.raises(ValueError, match=">= 0"):
            call()
    with pytest.raises(RuntimeError):  # an allocation too large: C++'s exception, raised in Python
        _C.string_rows([None], 1 << 50)
