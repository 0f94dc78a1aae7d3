"""A dataset's columns, declared once (Python or a TOML file).

    schema = Schema([Column("click", "label"), Column("price", "dense"),
                     Column("user_id", "categorical"), Column("item_id", "categorical", dtype="int"),
                     Column("history", "sequence", separator="|", max_length=50)],
                    delimiter=",", header=True)
    reader = CsvReader("clicks.csv", schema, batch_size=512)

What each kind becomes in a raw batch (the same conventions as CriteoReader):
    label        float32 [B]; must be 0 or 1, or, with positive_at=x, 1.0 where value >= x
    dense        float32 [B], NaN where missing
    categorical  dtype "string": deeprec.Ragged of bytes (uint8 values + int64 offsets, Arrow's
                 binary layout, zero-copy from the parsed Arrow column; b"" = missing);
                 dtype "int": int64 [B] (-1 = missing)
    sequence     deeprec.Ragged(values, offsets): values int64 (dtype "int") or a Ragged of bytes
                 (dtype "string"); row b holds values[offsets[b]:offsets[b+1]];
                 an empty field is an empty row; only the last max_length items are kept
    weight       float32 [B] (sample weights; missing = 1)
    ignore       read past, not returned
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from deeprec.errors import ConfigError, check_choice
from deeprec.options import read_toml
from deeprec.ragged import Ragged

KINDS = ("label", "dense", "categorical", "sequence", "weight", "ignore")
DTYPES = ("string", "int")


@dataclass(frozen=True)
class Column:
    name: str
    kind: str
    dtype: str = "string"  # categorical and sequence values
    separator: str = "|"  # sequence
    max_length: int | None = None  # sequence: keep the last max_length items
    positive_at: float | None = None  # label from a score: 1.0 where value >= positive_at
    role: str | None = None  # "user" | "item": which tower / query side a feature belongs to (DIN, DSSM)
    embed_with: str | None = None  # sequence: share the embedding table of this categorical (DIN history)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"a column needs a name, got {self.name!r}")
        check_choice(f"column {self.name!r} kind", self.kind, KINDS)
        check_choice(f"column {self.name!r} dtype", self.dtype, DTYPES)
        if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 1):
            raise ConfigError(f"column {self.name!r}: max_length must be a positive int, got {self.max_length!r}")
        if self.role is not None:
            check_choice(f"column {self.name!r} role", self.role, ("user", "item"))
        if self.embed_with is not None and self.kind != "sequence":
            raise ConfigError(f"column {self.name!r}: embed_with applies to sequence columns")
        if self.kind == "sequence" and not self.separator:
            raise ConfigError(f"column {self.name!r}: a sequence needs a separator")


@dataclass(frozen=True)
class Schema:
    """Columns in file order (all of them when the file has no header)."""

    columns: tuple[Column, ...]
    delimiter: str = ","  # "auto": tab if the first line has one, else comma
    header: bool | str = True  # True | False | "auto" (a header if the first line names the columns)
    name: str = "custom"
    _by_name: dict = field(default=None, init=False, repr=False, compare=False)
    _derived: dict = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        columns = tuple(self.columns)
        object.__setattr__(self, "columns", columns)
        if not columns:
            raise ConfigError("a schema needs at least one column")
        names = [c.name for c in columns]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"schema {self.name!r}: column(s) declared twice: {', '.join(dupes)}")
        if not self.labels:
            raise ConfigError(f"schema {self.name!r} declares no label column")
        for c in columns:
            if c.embed_with is not None and (c.embed_with not in names
                                             or columns[names.index(c.embed_with)].kind != "categorical"):
                raise ConfigError(f"schema {self.name!r}: column {c.name!r} embed_with={c.embed_with!r} must name "
                                  "a categorical column of the schema")
        if self.header not in (True, False, "auto"):
            raise ConfigError(f"schema header must be true, false or 'auto', got {self.header!r}")
        object.__setattr__(self, "_by_name", {c.name: c for c in columns})
        object.__setattr__(self, "_derived", {})

    def derived(self, key: str, make):
        """`make(self)`, computed once per schema object: what a server derives from it for every request
        (its inputs by kind), looked up without hashing the schema's columns."""
        if key not in self._derived:  # None is a value too (kept, not made again)
            self._derived[key] = make(self)
        return self._derived[key]

    # -- views -----------------------------------------------------------------------
    def of_kind(self, kind: str) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.kind == kind)

    @property
    def labels(self) -> tuple[str, ...]:
        return self.of_kind("label")

    @property
    def names(self) -> tuple[str, ...]:
        """The columns a batch holds, in declaration order."""
        return tuple(c.name for c in self.columns if c.kind != "ignore")

    @property
    def file_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def __getitem__(self, name: str) -> Column:
        return self._by_name[name]

    # -- parsing types ------------------------------------------------------------------
    def arrow_types(self, strict: bool) -> dict:
        """Column types for pyarrow's CSV reader; strict=False reads numbers as bytes
        (any bytes, UTF-8 or not) so each bad value can be found and reported."""
        types = {}
        for c in self.columns:
            if c.kind == "ignore":
                continue
            numeric = c.kind in ("label", "dense", "weight") or (c.kind == "categorical" and c.dtype == "int")
            if numeric:
                types[c.name] = (pa.int64() if c.kind == "categorical" else pa.float32()) if strict else pa.binary()
            else:
                types[c.name] = pa.binary()
        return types

    def numeric_columns(self) -> list[Column]:
        return [c for c in self.columns if c.kind in ("label", "dense", "weight")
                or (c.kind == "categorical" and c.dtype == "int")]

    # -- batches --------------------------------------------------------------------------
    def to_batch(self, table: pa.Table) -> dict:
        batch = {}
        for c in self.columns:
            if c.kind == "ignore":
                continue
            col = table.column(c.name)
            if c.kind in ("label", "dense", "weight"):
                batch[c.name] = number_tensor(c, np.asarray(col.to_numpy(), dtype=np.float32))
            elif c.kind == "categorical" and c.dtype == "int":
                arr = pc.fill_null(col, -1).to_numpy()
                batch[c.name] = torch.from_numpy(np.array(arr, dtype=np.int64))
            elif c.kind == "categorical":
                batch[c.name] = Ragged.from_arrow(col)
            else:
                batch[c.name] = split_sequence(col, c)
        return batch


def number_tensor(c: "Column", arr: np.ndarray) -> torch.Tensor:
    """A label, dense or weight column's float32 values (NaN: missing) as the batch holds them: a label
    thresholded at positive_at, a missing weight 1."""
    if c.kind == "label" and c.positive_at is not None:
        arr = (arr >= c.positive_at).astype(np.float32)
    if c.kind == "weight":
        arr = np.where(np.isnan(arr), np.float32(1.0), arr)
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


def number_tensors(columns: list, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`number_tensor` of each column's float32 values (views of one tensor, kept as they are where the
    column's kind leaves its values be)."""
    return [number_tensor(c, t.numpy()) if c.kind == "weight" or c.kind == "label" and c.positive_at is not None
            else t for c, t in zip(columns, tensors)]


_NUMBER = r"^\s*[-+]?((\d+\.?\d*)|(\.\d+))([eE][-+]?\d+)?\s*$|^\s*[-+]?(nan|NaN|inf|Inf|infinity|Infinity)\s*$"
_INTEGER = r"^\s*[-+]?\d+\s*$"


def parse_numbers(col, column: "Column"):
    """Text (string or any bytes) -> the column's number type, value by value:
    (typed column, ok mask, [(row, reason)] of the values that are not numbers).
    An empty value is missing (null), not bad."""
    integer = column.kind == "categorical"
    col = pc.cast(col, pa.binary())
    empty = pc.equal(col, b"")
    ok = pc.fill_null(pc.or_(empty, pc.match_substring_regex(col, _INTEGER if integer else _NUMBER)), True)
    bad = []
    if not pc.all(ok).as_py():
        values = col.to_pylist()
        kind = "an integer" if integer else "a number"
        for row in np.flatnonzero(~ok.to_numpy(zero_copy_only=False)):
            shown = values[row].decode("utf-8", errors="backslashreplace")
            bad.append((int(row), f"column {column.name}: {shown!r} is not {kind}"))
    clean = pc.cast(pc.if_else(pc.and_(ok, pc.invert(empty)), col, pa.scalar(None, pa.binary())), pa.string())
    clean = pc.utf8_trim_whitespace(clean)
    if not integer:
        return pc.cast(clean, pa.float32()), ok, bad
    try:
        return pc.cast(clean, pa.int64()), ok, bad
    except pa.ArrowInvalid:  # an integer beyond int64: a bad value like any other, the rest kept
        return _int64_in_range(clean, ok, bad, column)


def _int64_in_range(clean, ok, bad: list, column: "Column"):
    """`clean` (integers as text, null where missing or bad) as int64, values beyond int64 marked bad."""
    lo, hi = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    values = [None if v is None else int(v) for v in clean.to_pylist()]
    fits = [v is None or lo <= v <= hi for v in values]
    for row, (value, fit) in enumerate(zip(values, fits)):
        if not fit:
            bad.append((row, f"column {column.name}: '{value}' is beyond the int64 range"))
    typed = pa.array([v if fit else None for v, fit in zip(values, fits)], pa.int64())
    return typed, pc.and_(ok, pa.array(fits)), sorted(bad)


def check_values(schema: Schema, table: pa.Table, reasons: dict) -> object:
    """Rows whose values the model can train on, as a boolean array (None if no column is
    checked); adds "why not" per bad row to `reasons`:
    labels are 0/1 (or any number with positive_at); dense values and weights are finite
    float32 or missing (a value beyond float32's range reads as inf: it would turn the model to nan)."""
    valid = None
    for c in schema.columns:
        if c.kind not in ("label", "dense", "weight"):
            continue
        col = table.column(c.name)
        if c.kind == "label" and c.positive_at is None:  # must be exactly 0 or 1
            ok, wanted = pc.fill_null(pc.or_(pc.equal(col, 0.0), pc.equal(col, 1.0)), False), "0 or 1"
        elif c.kind == "label":  # a score: any finite number
            ok, wanted = pc.fill_null(pc.is_finite(col), False), "a finite number"
        else:  # missing (null, or nan as Parquet stores it) is filled by the schema's default; inf is not data
            ok, wanted = pc.fill_null(pc.invert(pc.is_inf(col)), True), "a finite float32 (|x| < 3.4e38) or missing"
        if not pc.all(ok).as_py():
            values = col.to_numpy(zero_copy_only=False)
            for row in np.flatnonzero(~ok.to_numpy(zero_copy_only=False)):
                value = values[row]
                shown = "nothing" if value is None or (c.kind == "label" and np.isnan(value)) else f"{float(value):g}"
                reasons.setdefault(int(row), f"{c.name} must be {wanted}, found {shown}")
        valid = ok if valid is None else pc.and_(valid, ok)
    return valid


def split_sequence(col, c: Column) -> Ragged:
    """A delimited text (or Arrow list) column -> Ragged; the last max_length items of each row."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):  # Parquet list columns
        lists = pc.fill_null(col, pa.scalar([], col.type))
    else:
        text = pc.cast(col, pa.string())
        lists = pc.split_pattern(pc.if_else(pc.equal(text, ""), pa.scalar(None, pa.string()), text), c.separator)
        lists = pc.fill_null(lists, pa.scalar([], pa.list_(pa.string())))
    if c.max_length is not None:
        offsets = np.asarray(lists.offsets.to_numpy(), dtype=np.int64)
        lengths = np.diff(offsets)
        if (lengths > c.max_length).any():  # keep each row's last max_length items
            starts = offsets[:-1] + np.maximum(lengths - c.max_length, 0) - offsets[0]
            kept = np.minimum(lengths, c.max_length)
            items = lists.flatten()
            take = np.repeat(starts - np.concatenate([[0], np.cumsum(kept)[:-1]]), kept) + np.arange(kept.sum())
            new_offsets = np.concatenate([[0], np.cumsum(kept)]).astype(np.int32)
            lists = pa.ListArray.from_arrays(pa.array(new_offsets, pa.int32()), items.take(pa.array(take)))
    if c.dtype == "int":
        try:
            lists = lists.cast(pa.list_(pa.int64()))
        except pa.ArrowInvalid as err:
            raise ConfigError(f"sequence column {c.name!r} is declared dtype='int' but holds {err}") from None
    else:
        lists = lists.cast(pa.list_(pa.binary()))
    return Ragged.from_arrow(lists)


def schema_to_dict(schema: Schema) -> dict:
    """The TOML layout as a dict (what checkpoints record)."""
    defaults = Column("x", "ignore")
    columns = [{k: v for k, v in vars(c).items() if k in ("name", "kind") or v != getattr(defaults, k)}
               for c in schema.columns]
    return {"name": schema.name, "delimiter": schema.delimiter, "header": schema.header, "column": columns}


def load_schema(path: str) -> Schema:
    """A schema from a TOML file:

        name = "clicks"
        delimiter = ","
        header = true
        [[column]]
        name = "click"
        kind = "label"
    """
    return schema_from_dict(read_toml(path, "--schema"), where=path)


def schema_from_dict(spec: dict, where: str = "schema") -> Schema:
    known = {"name", "delimiter", "header", "column"}
    extra = sorted(set(spec) - known)
    if extra:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(extra)}; allowed: {', '.join(sorted(known))}")
    columns = []
    for i, col in enumerate(spec.get("column", [])):
        try:
            columns.append(Column(**col))
        except TypeError as err:
            raise ConfigError(f"{where}: column {i + 1} ({col.get('name', '?')}): {err}") from None
    return Schema(tuple(columns), delimiter=spec.get("delimiter", ","), header=spec.get("header", True),
                  name=spec.get("name", os.path.basename(where)))
