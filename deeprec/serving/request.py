"""A request's columns -> the model's raw batch, meaning what the training reader's would mean.

A column is a JSON list (orjson-decoded) or a numpy array (KServe v2 binary tensors). Each becomes one
Arrow array in one vectorized call where it can: numbers, strings, lists of ids. Only a column that
mixes kinds (numbers and strings, say) takes a slower path. `Schema.to_batch`, the reader's own
conversion, then fills what is missing, so every value means here what it means in a training file:

    missing    null, "", an absent column, NaN, and the spellings the reader's number parse reads as
               missing ("NA", "null", "nan", ...): NaN in a dense column, -1 an int id, b"" a string id
    text       numbers sent as strings ("3", " 0.5", "1e3", int ids "17") are parsed to float32 / int64
               as the reader parses its text, not through a Python float
    bad value  a RequestError at its JSON path ($.inputs.I5[3]) in the reader's words ("'x' is not a
               number"); inf and numbers beyond float32 are refused, as the reader refuses them
"""
from __future__ import annotations

import collections
import functools
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from deeprec.data.schema import split_sequence
from deeprec.errors import DeepRecError
from deeprec.serving.common_values import common_batch


@functools.lru_cache(maxsize=1)
def _missing_lookup() -> tuple[pc.SetLookupOptions, pa.Scalar]:
    """The texts the reader's CSV parse reads as null, for is_in (built once: is_in would hash the set
    each call; on first use: pa.array of a list imports pandas, 0.15 s of every process's start), and
    the null text."""
    return pc.SetLookupOptions(pa.array(pacsv.ConvertOptions().null_values, pa.string())), pa.scalar(None, pa.string())


NUMBER_KINDS = ("label", "dense", "weight")
_WANTED_NUMBER = 'a finite number (float32: |x| <= 3.4e38), a numeric string, "" or null'
_WANTED_ID = 'an integer id (int64), a string of one, "" or null'
_ID_TYPES = (str, int, float)  # a sequence item (bool is an int: accepted, as str(True))


class RequestError(DeepRecError, ValueError):
    """A request that does not fit the model's schema: `str(err)` is "PATH: what is wrong", PATH the
    JSON path of the offending value (`$.inputs.I5[3]`); `err.path` and `err.reason` apart."""

    def __init__(self, reason: str, path: str = "$"):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def request_batch(schema, rows: dict, path: str = "$", max_rows: int | None = None) -> dict:
    """A raw batch from columns {name: values per row (a list or a 1-D numpy array)}; a column left out
    is all missing (labels may be left out). A value that does not fit is a RequestError at its path."""
    return convert_columns(schema, rows, request_rows(schema, rows, path, max_rows), path)


def request_rows(schema, rows: dict, path: str = "$", max_rows: int | None = None) -> int:
    """The rows of a request's columns, once their shape is checked (an object of lists of one length,
    columns of the schema, at most max_rows); the values are checked by `convert_columns`."""
    if not isinstance(rows, dict) or not rows:
        raise RequestError("the request must be an object of columns: {\"column\": [value per row], ...}", path)
    for name, values in rows.items():
        if not isinstance(values, (list, np.ndarray)) or isinstance(values, np.ndarray) and values.ndim != 1:
            got = f"a {values.ndim}-D array" if isinstance(values, np.ndarray) else _shown(values)
            raise RequestError(f"field {name!r}: must be a list (one value per row), got {got}", key(path, name))
    names = {c.name for c in schema.columns}
    unknown = [name for name in rows if name not in names]
    if unknown:
        inputs = [c.name for c in schema.columns if c.kind not in ("label", "ignore")]
        raise RequestError(f"field {unknown[0]!r} is not a column of the model's schema (its columns: "
                           f"{', '.join(inputs)})", key(path, unknown[0]))
    lengths = {len(v) for v in rows.values()}
    n = lengths.pop()
    if lengths:  # the odd one out is named
        n = collections.Counter(len(v) for v in rows.values()).most_common(1)[0][0]
        for c in schema.columns:
            if c.kind != "ignore" and c.name in rows and len(rows[c.name]) != n:
                raise RequestError(f"field {c.name!r}: {len(rows[c.name])} values, other fields have {n}",
                                   key(path, c.name))
    if n == 0:
        raise RequestError("0 rows: a request needs at least one row (each field a list of one value per row)", path)
    if max_rows is not None and n > max_rows:
        raise RequestError(f"{n} rows, this server takes at most {max_rows} per request (--max-rows): split the "
                           "request", path)
    return n


def convert_columns(schema, rows: dict, n: int, path: str = "$") -> dict:
    """Columns whose shape `request_rows` checked (n rows) -> the raw batch."""
    batch = common_batch(schema, rows, n)
    return batch if batch is not None else arrow_batch(schema, rows, n, path)


def arrow_batch(schema, rows: dict, n: int, path: str = "$") -> dict:
    """`convert_columns` through Arrow: any request, any value; a bad one named at its path."""
    columns = _numbers_as_text(schema, rows, n, path)
    for c in schema.columns:
        if c.kind != "ignore" and c.name not in columns:
            columns[c.name] = column_array(c, rows.get(c.name), n, key(path, c.name))
    columns = {c.name: columns[c.name] for c in schema.columns if c.kind != "ignore"}
    try:
        return schema.to_batch(pa.table(columns))
    except (DeepRecError, pa.ArrowException, ValueError, TypeError, OverflowError) as err:  # checked above
        raise RequestError(f"the values do not fit the model's schema ({err})", path) from None


def merge_columns(requests: list[tuple[dict, int]]) -> dict | None:
    """The columns of several checked requests ((columns, rows) each) as one request's: a column is
    the concatenation of theirs, all missing where a request left it out. What it converts to equals
    the requests' batches converted alone and stacked (a value means the same in any row; one
    exception: a dense integer beyond 2**53 beside another request's floats is rounded to a double
    first, which may move it one float32 step). None
    where a column mixes lists and numpy arrays, or arrays of two dtypes (each request is then
    converted alone)."""
    names = list(dict.fromkeys(name for columns, _ in requests for name in columns))
    merged = {}
    for name in names:
        parts = [(columns.get(name), n) for columns, n in requests]
        if all(isinstance(values, list) or values is None for values, _ in parts):
            merged[name] = [v for values, n in parts for v in (values if values is not None else [None] * n)]
        elif all(isinstance(values, np.ndarray) for values, _ in parts) and len({v.dtype for v, _ in parts}) == 1:
            merged[name] = np.concatenate([values for values, _ in parts])
        else:
            return None
    return merged


def _numbers_as_text(schema, rows: dict, n: int, path: str) -> dict:
    """The number columns sent as text (lists of strings, as a file holds them) parsed together, in one
    pass: on a short request Arrow's cost per call, not per value, is what counts. Any refusal: {} (each
    column is then parsed alone, and the first bad value named at its field and row)."""
    columns = [c for c in schema.columns if c.kind in NUMBER_KINDS and isinstance(rows.get(c.name), list)
               and isinstance(rows[c.name][0], str)]
    if len(columns) < 2:
        return {}
    joined = []
    for c in columns:
        joined += rows[c.name]
    try:
        parsed = _parse_text(columns[0], pa.array(joined, pa.string()), joined, path, False)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):  # RequestError included
        return {}
    out = {c.name: parsed.slice(k * n, n) for k, c in enumerate(columns)}
    for c in columns:
        _refuse_infinite(c, out[c.name], rows[c.name], key(path, c.name))
    return out


def column_array(c, values, n: int, path: str) -> pa.Array:
    """One column as the reader's parse gives it (before `Schema.to_batch`); None: absent, all missing."""
    if values is None:
        return _absent(c, n)
    if c.kind in NUMBER_KINDS or c.dtype == "int" and c.kind == "categorical":
        integer = c.kind == "categorical"
        if not integer and isinstance(values, list) and not isinstance(values[0], str):  # (a refusal costs)
            try:  # numbers and nulls, the common case: one call (a double rounds to float32 as the cast does)
                array = pa.array(values, pa.float32())
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                pass
            else:
                _refuse_infinite(c, array, values, path)
                return array
        raw = _raw(values)
        array = _mixed_numbers(c, values, path, integer) if raw is None else _numbers(c, raw, values, path, integer)
        if not integer:
            _refuse_infinite(c, array, values, path)
        return array
    if c.kind == "categorical":
        return _string_ids(c, values, path)
    return _sequence(c, values, path)


def _absent(c, n: int) -> pa.Array:
    if c.kind == "label":  # not an input: zeros, as `ServedModel.logits` fills a label left out
        return pa.array(np.zeros(n, np.float32))
    if c.kind in NUMBER_KINDS:
        return pa.nulls(n, pa.float32())
    if c.kind == "categorical" and c.dtype == "int":
        return pa.nulls(n, pa.int64())
    return pc.fill_null(pa.nulls(n, pa.string()), "")  # a string id b"" / an empty sequence


def _raw(values) -> pa.Array | None:
    """The column as one Arrow array, its type inferred (numpy: its dtype's); None when the values mix
    kinds Arrow cannot put in one array (numbers and strings, a lone surrogate, an int beyond 64 bits)."""
    try:
        if isinstance(values, np.ndarray):
            return pa.array(values.tolist() if values.dtype.kind == "O" else values)
        return pa.array(values)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None


def _numbers(c, raw: pa.Array, values, path: str, integer: bool) -> pa.Array:
    """A column of one Arrow type -> float32 (dense, label, weight) or int64 (an int categorical)."""
    kind = raw.type
    target = pa.int64() if integer else pa.float32()
    if pa.types.is_null(kind):
        return pa.nulls(len(raw), target)
    if pa.types.is_string(kind) or pa.types.is_binary(kind):
        return _parse_text(c, raw, values, path, integer)
    if pa.types.is_boolean(kind) or not integer and (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        return pc.cast(raw, target, safe=False)  # double -> float32 rounds to nearest, as the reader's parse
    if pa.types.is_integer(kind):
        try:
            return raw if kind == pa.int64() else pc.cast(raw, pa.int64())
        except pa.ArrowInvalid:  # uint64 beyond int64
            i = int(np.flatnonzero(raw.to_numpy(zero_copy_only=False) > 2 ** 63 - 1)[0])
            raise _not_parsed(c, values[i], path, i, integer) from None
    if pa.types.is_floating(kind):  # an int id sent as 17.0 is 17; 2.5 is not an id; NaN is missing
        x = raw.to_numpy(zero_copy_only=False).astype(np.float64)
        bad = ~np.isnan(x) & ((np.abs(x) >= 2.0 ** 63) | (x != np.floor(x)))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise _not_parsed(c, values[i], path, i, integer)
        return pa.array(np.nan_to_num(x).astype(np.int64), mask=np.isnan(x))
    i = int(np.flatnonzero(pc.is_valid(raw).to_numpy(zero_copy_only=False))[0])  # lists, objects
    raise RequestError(f"field {c.name!r}: expected {_WANTED_ID if integer else _WANTED_NUMBER}, got "
                       f"{_shown(values[i])}", f"{path}[{i}]")


def _parse_text(c, raw: pa.Array, values, path: str, integer: bool, rows=None) -> pa.Array:
    """Numbers as text -> float32 / int64 as the reader's CSV parse reads them: its missing spellings
    null, spaces and tabs around a number ignored, the text cast straight to the type (one rounding).
    `rows`: the request row of each value, if `raw` holds some of a column's values."""
    target = pa.int64() if integer else pa.float32()
    text = raw
    if not pa.types.is_string(raw.type):
        try:
            text = pc.cast(raw, pa.string())
        except pa.ArrowInvalid:  # bytes that are not UTF-8
            i = _first_failing(raw, lambda part: pc.cast(part, pa.string()))
            raise _not_parsed(c, values[i], path, i if rows is None else rows[i], integer) from None
    missing, null_text = _missing_lookup()
    clean = pc.if_else(pc.is_in(text, options=missing), null_text, text)
    if integer:  # "+3" is 3, as the reader reads it
        clean = pc.replace_substring_regex(clean, r"^([ \t]*)\+", r"\1")
    try:
        return pc.cast(clean, target)
    except pa.ArrowInvalid:  # spaces or tabs around a number (trimmed only then: a call saved), or not a number
        clean = pc.utf8_trim(clean, " \t")
    try:
        return pc.cast(clean, target)
    except pa.ArrowInvalid:
        i = _first_failing(clean, lambda part: pc.cast(part, target))
        raise _not_parsed(c, values[i], path, i if rows is None else rows[i], integer) from None


def _first_failing(array: pa.Array, convert) -> int:
    """The first row `convert` refuses, found by halving (log2(rows) calls); `convert(array)` failed."""
    lo, hi = 0, len(array)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            convert(array.slice(lo, mid - lo))
            lo = mid
        except pa.ArrowInvalid:
            hi = mid
    return lo


def _not_parsed(c, value, path: str, i: int, integer: bool) -> RequestError:
    """The reader's words for a value that is not a number ("column I5: 'x' is not a number")."""
    value = value.item() if isinstance(value, np.generic) else value
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="backslashreplace")
    what, wanted = ("an integer", _WANTED_ID) if integer else ("a number", _WANTED_NUMBER)
    return RequestError(f"field {c.name!r}: {value!r} is not {what} (expected {wanted})", f"{path}[{i}]")


def _mixed_numbers(c, values, path: str, integer: bool) -> pa.Array:
    """Numbers and numeric strings mixed in one column: the numbers one by one, the strings together;
    the first bad value (in row order) is the one named."""
    n = len(values)
    out = np.zeros(n, np.int64) if integer else np.full(n, np.nan, np.float64)
    missing = np.ones(n, bool)
    text_rows, error = [], None  # strings before the first bad number or object
    for i, v in enumerate(values.tolist() if isinstance(values, np.ndarray) else values):
        if v is None:
            continue
        if isinstance(v, (str, bytes)):
            text_rows.append(i)
            continue
        try:
            if not isinstance(v, (int, float)):
                raise TypeError
            number = float(v) if not integer or isinstance(v, float) else v
            if number == number:  # NaN is missing
                if integer and (number != int(number) or not -2 ** 63 <= int(number) < 2 ** 63):
                    raise ValueError
                out[i], missing[i] = int(number) if integer else number, False
        except (TypeError, ValueError, OverflowError):
            if isinstance(v, (int, float)):
                error = _not_parsed(c, v, path, i, integer)
            else:
                wanted = _WANTED_ID if integer else _WANTED_NUMBER
                error = RequestError(f"field {c.name!r}: expected {wanted}, got {_shown(v)}", f"{path}[{i}]")
            break
    if text_rows:  # a bad string (all come before `error`'s row) is the first bad value
        texts = [values[i] for i in text_rows]
        try:
            raw = pa.array(texts, pa.string())
        except (pa.ArrowException, ValueError):  # bytes not UTF-8, or a lone surrogate: as bytes, named after
            raw = pa.array([t.encode("utf-8", "surrogatepass") if isinstance(t, str) else t for t in texts],
                           pa.binary())
        parsed = _parse_text(c, raw, texts, path, integer, text_rows)
        rows = np.array(text_rows)
        valid = parsed.is_valid().to_numpy(zero_copy_only=False)
        out[rows[valid]] = parsed.filter(parsed.is_valid()).to_numpy()
        missing[rows[valid]] = False
    if error is not None:
        raise error
    if integer:
        return pa.array(out, mask=missing)
    with np.errstate(over="ignore"):  # beyond float32: inf, refused after
        return pa.array(np.where(missing, np.nan, out).astype(np.float32))


def _refuse_infinite(c, array: pa.Array, values, path: str) -> None:
    """inf, and a number beyond float32 (read as inf), are refused as the reader refuses them: they would
    turn the model's output to NaN. NaN itself is missing."""
    infinite = np.isinf(array.to_numpy(zero_copy_only=False))  # a null reads as NaN
    if not infinite.any():
        return
    i = int(np.flatnonzero(infinite)[0])
    value = values[i].item() if isinstance(values[i], np.generic) else values[i]
    try:
        beyond = " (beyond float32's range)" if np.isfinite(float(value)) else ""
    except (TypeError, ValueError, OverflowError):  # text float() cannot read ("INF"), or an int past float64
        beyond = "" if isinstance(value, (str, bytes)) else " (beyond float32's range)"
    raise RequestError(f"field {c.name!r}: expected {_WANTED_NUMBER}, got {_shown(value)}{beyond}", f"{path}[{i}]")


def _string_ids(c, values, path: str) -> pa.Array:
    """A string categorical: strings (or bytes) as they are, numbers as their text, null -> "" (missing,
    as an empty field in a file)."""
    if isinstance(values, np.ndarray):
        if values.dtype.kind in "US":  # str_ / bytes_ arrays: Arrow reads them whole
            return pa.array(values)
        values = values.tolist()
    try:
        return _filled(pa.array(values, pa.string()))  # strings and nulls: one call
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        pass
    raw = _raw(values)
    if raw is not None and pa.types.is_integer(raw.type):  # ids sent as numbers: their decimal text
        return _filled(pc.cast(raw, pa.string()))
    out = []
    for i, v in enumerate(values):  # mixed: one by one
        if isinstance(v, (list, dict)):
            raise RequestError(f"field {c.name!r}: expected an id (a string or a number) or null, got {_shown(v)}",
                               f"{path}[{i}]")
        try:
            out.append(b"" if v is None else v if isinstance(v, bytes) else str(v).encode())
        except (TypeError, ValueError) as err:  # a lone surrogate
            raise RequestError(f"field {c.name!r}: {err}", f"{path}[{i}]") from None
    return pa.array(out, pa.binary())


def _filled(strings: pa.Array) -> pa.Array:
    """null -> "" (fill_null costs more than the column itself on a short request: only when needed)."""
    return pc.fill_null(strings, "") if strings.null_count else strings


def _sequence(c, values, path: str) -> pa.Array:
    """A sequence: per row a list of ids, the ids joined by the column's separator as one string ("" and
    null: an empty row), as the reader's text; int ids checked as the reader casts them."""
    if isinstance(values, np.ndarray):
        values = values.tolist()
    raw = _raw(values)
    text = None
    if raw is not None and (pa.types.is_null(raw.type) or pa.types.is_string(raw.type)):
        text = pc.cast(raw, pa.string())
    elif raw is not None and pa.types.is_list(raw.type) and pc.list_flatten(raw).null_count == 0:
        items = raw.type.value_type
        if c.dtype == "int" and pa.types.is_integer(items):  # lists of int ids: what the reader's cast gives
            return raw
        if pa.types.is_integer(items) or pa.types.is_string(items) or pa.types.is_null(items):
            lists = pc.cast(raw, pa.list_(pa.string()))
            if not pc.any(pc.match_substring(pc.list_flatten(lists), c.separator)).as_py():
                text = pc.binary_join(lists, c.separator)
    if text is None:
        text = _joined(c, values, path)
    if c.dtype == "int":  # each id must read as an int64 (as the reader casts it)
        try:
            split_sequence(text, c)
        except (DeepRecError, pa.ArrowException):
            raise _bad_int_sequence(c, values, [t or "" for t in text.to_pylist()], path) from None
    return text


def _joined(c, values: list, path: str) -> pa.Array:
    """A sequence column mixing lists and strings, row by row: each list's ids joined by the separator."""
    field, sep = f"field {c.name!r}", c.separator
    wanted = (f"a list of {'integer ids' if c.dtype == 'int' else 'ids (strings or numbers)'}, "
              f"a string of ids joined by {sep!r}, or null")
    texts = []
    for i, v in enumerate(values):
        if v is None:
            texts.append("")
        elif isinstance(v, list):
            for j, item in enumerate(v):
                if not isinstance(item, _ID_TYPES) or (isinstance(item, str) and sep in item):
                    why = f"an id containing the separator {sep!r}" if isinstance(item, str) else _shown(item)
                    raise RequestError(f"{field}: a sequence holds ids, got {why} (expected {wanted})",
                                       f"{path}[{i}][{j}]")
            texts.append(sep.join(map(str, v)))
        elif isinstance(v, dict):
            raise RequestError(f"{field}: expected {wanted}, got {_shown(v)}", f"{path}[{i}]")
        elif isinstance(v, bytes):  # a KServe BYTES element: UTF-8 text
            try:
                texts.append(v.decode())
            except UnicodeDecodeError as err:
                raise RequestError(f"{field}: bytes that are not UTF-8 text ({err.reason})", f"{path}[{i}]") from None
        else:
            texts.append(str(v))
    try:
        return pa.array(texts, pa.string())
    except (TypeError, ValueError) as err:  # a lone surrogate
        i = next(i for i, t in enumerate(texts) if any("\ud800" <= ch <= "\udfff" for ch in t))
        raise RequestError(f"{field}: {err}", f"{path}[{i}]") from None


def _bad_int_sequence(c, values: list, texts: list, path: str) -> RequestError:
    """The error of the first row of an int sequence column holding an id that is not an int64."""
    sep = c.separator
    for i, text in enumerate(texts):
        items = text.split(sep) if text else []
        first = max(0, len(items) - c.max_length) if c.max_length else 0  # the reader keeps the last max_length
        j = next((j for j in range(first, len(items)) if _not_int64(items[j])), None)
        if j is None:
            continue
        if isinstance(values[i], list):
            return RequestError(f"field {c.name!r}: expected integer ids (int64), got {_shown(values[i][j])}",
                                f"{path}[{i}][{j}]")
        return RequestError(f"field {c.name!r}: expected integer ids (int64) joined by {sep!r}, got "
                            f"{_shown(values[i])} (id {j + 1}: {items[j]!r})", f"{path}[{i}]")
    return RequestError(f"field {c.name!r}: expected integer ids (int64)", path)


def _not_int64(text: str) -> bool:
    try:
        pa.array([text], pa.string()).cast(pa.int64())
        return False
    except pa.ArrowException:
        return True


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@functools.lru_cache(maxsize=4096)  # built for every column of every request, though seldom shown
def key(path: str, name: str) -> str:
    """`path` + the object key `name`, as a JSON path: $.inputs.I5, or $.inputs["odd name"]."""
    return f"{path}.{name}" if _IDENTIFIER.fullmatch(name) else f"{path}[{json.dumps(name)}]"


def _shown(value) -> str:
    """A value as an error names it: JSON text, cut short, or its JSON type for containers."""
    value = value.item() if isinstance(value, np.generic) else value
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, float) and not np.isfinite(value):
        text = "nan" if value != value else ("inf" if value > 0 else "-inf")
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):  # bytes, or what no JSON holds
            text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def is_columns(batch: dict) -> bool:
    """A request's columns (lists or numpy arrays), not a reader's raw batch (tensors and Ragged)."""
    return any(isinstance(v, (list, np.ndarray)) for v in batch.values())
