"""Delimited text files (CSV, TSV) of any schema: `CsvReader(paths, schema, batch_size)`.

Files are split into byte ranges, one per shard, cut at line starts: a line
belongs to the range its first byte falls in, so every row is read by exactly
one shard. Each range is read in newline-aligned chunks parsed by pyarrow;
memory stays bounded by the chunk size whatever the file size. A row that does
not fit the schema (wrong field count, a non-number in a numeric column, a label
that is not 0/1) is raised as DataError with file:line, or skipped and counted
(`on_bad_row="skip"`).
"""
from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from deeprec.data.reader import BatchReader, resolve_paths
from deeprec.data.schema import Schema, check_values
from deeprec.errors import DataError

CHUNK_BYTES = 4 << 20
_NUMBER = r"^\s*[-+]?((\d+\.?\d*)|(\.\d+))([eE][-+]?\d+)?\s*$|^\s*[-+]?(nan|NaN|inf|Inf|infinity|Infinity)\s*$"
_INTEGER = r"^\s*[-+]?\d+\s*$"


@dataclass(frozen=True)
class FileLayout:
    delimiter: str
    names: tuple[str, ...]  # column names in file order
    data_start: int  # byte offset of the first data line


def summarize_names(names) -> str:
    """label, I1..I13, C1..C26: runs of numbered names shortened."""
    out, run = [], []

    def flush():
        if len(run) > 2:
            out.append(f"{run[0]}..{run[-1]}")
        else:
            out.extend(run)
        run.clear()

    for name in names:
        m = re.fullmatch(r"(\D+)(\d+)", name)
        prev = re.fullmatch(r"(\D+)(\d+)", run[-1]) if run else None
        if m and prev and m.group(1) == prev.group(1) and int(m.group(2)) == int(prev.group(2)) + 1:
            run.append(name)
            continue
        flush()
        run.append(name)
    flush()
    return ", ".join(out)


def detect_layout(path: str, schema: Schema) -> FileLayout:
    """The delimiter and whether the first line is a header, checked against the schema."""
    with open(path, "rb") as f:
        first = f.readline()
    if first.startswith(b"\x1f\x8b"):
        raise DataError("gzip-compressed input is not read directly (byte-range sharding needs "
                        "seekable text): decompress it first (gunzip -k FILE)", path)
    text = first.decode("utf-8", errors="replace").rstrip("\r\n")
    delimiter = schema.delimiter if schema.delimiter != "auto" else ("\t" if "\t" in text else ",")
    fields = [f.strip().strip('"') for f in text.split(delimiter)]
    header = schema.header
    if header == "auto":  # a header names at least one declared column; data does not
        header = any(name in fields for name in schema.file_names)
    expected = schema.file_names
    if not header:
        if len(fields) != len(expected):
            raise DataError(f"expected {len(expected)} fields ({summarize_names(expected)}) in a "
                            f"headerless {schema.name} file, found {len(fields)}", path, 1)
        return FileLayout(delimiter, expected, 0)
    missing = [n for n in schema.names if n not in fields]
    if missing:
        raise DataError(f"header lacks column(s) {', '.join(missing)}; the {schema.name} schema declares "
                        f"{summarize_names(schema.names)}", path, 1)
    return FileLayout(delimiter, tuple(fields), len(first))


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


class CsvReader(BatchReader):
    """Streaming reader of delimited text; yields raw batches as `schema` describes.

    Deterministic for a given seed; every valid row appears exactly once per
    epoch over all shards; `state_dict()` / `load_state_dict()` resume.
    """

    def __init__(self, paths, schema: Schema, batch_size: int, *, chunk_bytes: int = CHUNK_BYTES, **kwargs):
        super().__init__(resolve_paths(paths), batch_size, schema, **kwargs)
        self.schema = schema
        self.chunk_bytes = chunk_bytes
        self._layouts = {p: detect_layout(p, schema) for p in self.paths}

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
        schema = self.schema
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
                convert_options=pacsv.ConvertOptions(column_types=types, include_columns=list(schema.names),
                                                     strings_can_be_null=False, quoted_strings_can_be_null=False),
            )

        try:
            table = read(schema.arrow_types(strict=True))
            bad, valid = [], None
        except pa.ArrowInvalid:  # a non-number somewhere: validate value by value
            table, bad, valid = _validate_numbers(read(schema.arrow_types(strict=False)), schema)
        locator = _Locator(path, layout, offset, chunk)
        problems = [(lambda k=k: locator.bad_width_line(k), f"expected {len(layout.names)} fields, found {w}")
                    for k, w in enumerate(wrong_width)]
        reasons = dict(bad)
        label_ok = check_values(schema, table, reasons)
        if label_ok is not None:
            valid = label_ok if valid is None else pc.and_(valid, label_ok)
        if valid is not None and not pc.all(valid).as_py():
            for row in np.flatnonzero(~valid.to_numpy(zero_copy_only=False)):
                problems.append((lambda row=int(row): locator.data_row_line(row), reasons[int(row)]))
            table = table.filter(valid)
        if problems:
            self._report(path, problems)
        return table


def _validate_numbers(table: pa.Table, schema: Schema):
    """Cast numeric text columns to their types, marking values that are not numbers."""
    valid = None
    bad: list[tuple[int, str]] = []
    for column in schema.numeric_columns():
        name = column.name
        integer = column.kind == "categorical"
        col = table.column(name)
        empty = pc.equal(col, "")
        ok = pc.or_(empty, pc.match_substring_regex(col, _INTEGER if integer else _NUMBER))
        if not pc.all(ok).as_py():
            values = col.to_pylist()
            kind = "an integer" if integer else "a number"
            for row in np.flatnonzero(~ok.to_numpy(zero_copy_only=False)):
                bad.append((int(row), f"column {name}: {values[row]!r} is not {kind}"))
        clean = pc.if_else(pc.and_(ok, pc.invert(empty)), col, pa.scalar(None, pa.string()))
        typed = pc.cast(pc.utf8_trim_whitespace(clean), pa.int64() if integer else pa.float32())
        table = table.set_column(table.schema.get_field_index(name), name, typed)
        valid = ok if valid is None else pc.and_(valid, ok)
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
