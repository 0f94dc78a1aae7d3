"""Criteo click logs: the Kaggle/Terabyte TSV layout (no header) and CSV with a header.

Files are split into byte ranges, one per shard, cut at line starts: a line
belongs to the range its first byte falls in, so every row is read by exactly
one shard. Each range is read in newline-aligned chunks parsed by pyarrow;
memory stays bounded by the chunk size whatever the file size.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from deeprec.data.reader import BatchReader, ColumnSpec, resolve_paths
from deeprec.errors import DataError

LABEL = "label"
DENSE = tuple(f"I{i}" for i in range(1, 14))
SPARSE = tuple(f"C{i}" for i in range(1, 27))
CRITEO_COLUMNS = ColumnSpec(labels=(LABEL,), dense=DENSE, strings=SPARSE)
CHUNK_BYTES = 4 << 20
_NUMBER = r"^\s*[-+]?((\d+\.?\d*)|(\.\d+))([eE][-+]?\d+)?\s*$|^\s*[-+]?(nan|NaN|inf|Inf|infinity|Infinity)\s*$"


@dataclass(frozen=True)
class FileLayout:
    delimiter: str
    names: tuple[str, ...]  # column names in file order
    data_start: int  # byte offset of the first data line


def detect_layout(path: str) -> FileLayout:
    """TSV without header (label, I1..I13, C1..C26) or delimited text with a header."""
    with open(path, "rb") as f:
        first = f.readline()
    if first.startswith(b"\x1f\x8b"):
        raise DataError("gzip-compressed input is not read directly (byte-range sharding needs "
                        "seekable text): decompress it first (gunzip -k FILE)", path)
    text = first.decode("utf-8", errors="replace").rstrip("\r\n")
    delimiter = "\t" if "\t" in text else ","
    fields = text.split(delimiter)
    expected = CRITEO_COLUMNS.names
    if fields and fields[0].strip() in ("0", "1", ""):
        if len(fields) != len(expected):
            raise DataError(f"expected {len(expected)} fields (label, I1..I13, C1..C26) in a "
                            f"headerless Criteo file, found {len(fields)}", path, 1)
        return FileLayout(delimiter, expected, 0)
    names = tuple(name.strip() for name in fields)
    missing = [n for n in expected if n not in names]
    if missing:
        raise DataError(f"header lacks column(s) {', '.join(missing)}; a Criteo file has "
                        f"label, I1..I13, C1..C26 (or no header at all)", path, 1)
    return FileLayout(delimiter, names, len(first))


def count_lines_before(path: str, offset: int) -> int:
    """Number of newlines in the first `offset` bytes (for error locations)."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            block = f.read(min(offset, 16 << 20))
            if not block:
                break
            count += block.count(b"\n")
            offset -= len(block)
    return count


def iter_line_chunks(path: str, start: int, end: int, data_start: int,
                     chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) chunks holding exactly the lines that begin in [start, end)."""
    with open(path, "rb") as f:
        pos = max(start, data_start)
        if pos > data_start:  # move to the first line that begins at or after `start`
            f.seek(pos - 1)
            pos = pos - 1 + len(f.readline())
        f.seek(pos)
        while pos < end:
            block = f.read(chunk_bytes)
            if not block:
                return
            if pos + len(block) >= end:  # last chunk: finish the line holding byte end-1
                newline = block.find(b"\n", end - 1 - pos)
            else:
                newline = block.rfind(b"\n")
            if newline == -1:  # a line longer than the block, or the file's unterminated tail
                block += f.readline()
                newline = len(block) - 1
            chunk = block[: newline + 1]
            yield pos, chunk
            pos += len(chunk)
            f.seek(pos)


class CriteoReader(BatchReader):
    """Streaming reader of Criteo click logs; yields raw batches.

    A batch is a dict: ``label`` float32 [B], ``I1``..``I13`` float32 [B]
    (NaN = missing), ``C1``..``C26`` numpy object arrays of raw ``bytes``
    (b"" = missing). Deterministic for a given seed; every valid row appears
    exactly once per epoch over all shards.
    """

    def __init__(self, paths, batch_size: int, *, chunk_bytes: int = CHUNK_BYTES, **kwargs):
        super().__init__(resolve_paths(paths), batch_size, CRITEO_COLUMNS, **kwargs)
        self.chunk_bytes = chunk_bytes
        self._layouts = {p: detect_layout(p) for p in self.paths}

    def _all_units(self) -> list:
        # Each file is cut into num_shards byte ranges; range k is unit k of the file,
        # so by the base class's round-robin rule it belongs to shard k.
        units = []
        for path in self.paths:
            layout = self._layouts[path]
            size = os.path.getsize(path)
            body = max(size - layout.data_start, 0)
            bounds = [layout.data_start + body * k // self.num_shards for k in range(self.num_shards + 1)]
            units.extend((path, bounds[k], bounds[k + 1]) for k in range(self.num_shards))
        return units

    def _read_unit(self, unit) -> Iterator[pa.Table]:
        path, start, end = unit
        layout = self._layouts[path]
        for offset, chunk in iter_line_chunks(path, start, end, layout.data_start, self.chunk_bytes):
            yield self._parse_chunk(path, layout, offset, chunk)

    # -- parsing ---------------------------------------------------------------
    def _parse_chunk(self, path: str, layout: FileLayout, offset: int, chunk: bytes) -> pa.Table:
        wrong_width: list[int] = []  # field counts of rows pyarrow rejected, in order

        def on_invalid(row):
            wrong_width.append(row.actual_columns)
            return "skip"

        def read(types):
            del wrong_width[:]
            return pacsv.read_csv(
                io.BytesIO(chunk),
                read_options=pacsv.ReadOptions(column_names=list(layout.names), use_threads=False,
                                               block_size=len(chunk) + 1),
                parse_options=pacsv.ParseOptions(delimiter=layout.delimiter, invalid_row_handler=on_invalid),
                convert_options=pacsv.ConvertOptions(column_types=types, include_columns=list(CRITEO_COLUMNS.names),
                                                     strings_can_be_null=False, quoted_strings_can_be_null=False),
            )

        typed = {LABEL: pa.float32(), **{c: pa.float32() for c in DENSE}, **{c: pa.binary() for c in SPARSE}}
        try:
            table = read(typed)
            bad, valid = [], None
        except pa.ArrowInvalid:  # a non-numeric value somewhere: validate value by value
            table = read({**{c: pa.string() for c in (LABEL,) + DENSE}, **{c: pa.binary() for c in SPARSE}})
            table, bad, valid = _validate_numbers(table)
        locator = _Locator(path, layout, offset, chunk)
        problems = [(lambda k=k: locator.bad_width_line(k), f"expected {len(layout.names)} fields, found {w}")
                    for k, w in enumerate(wrong_width)]
        label = table.column(LABEL)  # must be exactly 0 or 1
        label_ok = pc.fill_null(pc.or_(pc.equal(label, 0.0), pc.equal(label, 1.0)), False)
        valid = label_ok if valid is None else pc.and_(valid, label_ok)
        if not pc.all(valid).as_py():
            reasons = dict(bad)
            label_np = label.to_numpy(zero_copy_only=False)
            for row in np.flatnonzero(~valid.to_numpy(zero_copy_only=False)):
                reason = reasons.get(int(row)) or f"label must be 0 or 1, found {_show(label_np[row])}"
                problems.append((lambda row=int(row): locator.data_row_line(row), reason))
            table = table.filter(valid)
        if problems:
            self._report(path, problems)
        return table


def _show(value) -> str:
    if value is None or np.isnan(value):
        return "nothing"
    return f"{float(value):g}"


def _validate_numbers(table: pa.Table):
    """Cast label and dense string columns to float32, marking non-numeric values."""
    valid = None
    bad: list[tuple[int, str]] = []
    columns = {}
    for name in (LABEL,) + DENSE:
        col = table.column(name)
        empty = pc.equal(col, "")
        ok = pc.or_(empty, pc.match_substring_regex(col, _NUMBER))
        if not pc.all(ok).as_py():
            values = col.to_pylist()
            for row in np.flatnonzero(~ok.to_numpy(zero_copy_only=False)):
                bad.append((int(row), f"column {name}: {values[row]!r} is not a number"))
        clean = pc.if_else(pc.and_(ok, pc.invert(empty)), col, pa.scalar(None, pa.string()))
        columns[name] = pc.cast(pc.utf8_trim_whitespace(clean), pa.float32())
        valid = ok if valid is None else pc.and_(valid, ok)
    table = table.select(list(CRITEO_COLUMNS.names))
    for name, col in columns.items():
        table = table.set_column(table.schema.get_field_index(name), name, col)
    bad.sort()
    return table, bad, valid


class _Locator:
    """Maps a row of a chunk back to its physical line number (error path only)."""

    def __init__(self, path, layout, offset, chunk):
        self.path, self.layout, self.offset, self.chunk = path, layout, offset, chunk
        self._rows = None

    def _classify(self):
        if self._rows is None:
            base = count_lines_before(self.path, self.offset) + 1
            width = len(self.layout.names)
            good, wrong = [], []
            for i, line in enumerate(self.chunk.split(b"\n")):
                if not line.strip(b"\r"):
                    continue  # pyarrow skips empty lines
                (good if len(line.split(self.layout.delimiter.encode())) == width else wrong).append(base + i)
            self._rows = (good, wrong)
        return self._rows

    def data_row_line(self, row: int):
        return self._classify()[0][row]

    def bad_width_line(self, k: int):
        return self._classify()[1][k]
