"""Delimited text files (CSV, TSV) of any schema: `CsvReader(paths, schema, batch_size)`.

Files are split into byte ranges, one per shard, cut at line starts: a line
belongs to the range its first byte falls in, so every row is read by exactly
one shard. Each range is read in newline-aligned chunks parsed by pyarrow;
memory stays bounded by the chunk size whatever the file size. A row that does
not fit the schema (wrong field count, a non-number in a numeric column, a label
that is not 0/1) is raised as DataError with file:line, or skipped and counted
(`on_bad_row="skip"`).

Files may be URLs (`deeprec.data.fs`): a byte range is read with ranged GETs and read-ahead, never
the whole object. Compressed files (.gz, .zst, .bz2) cannot be cut by bytes: each is one unit,
read as a stream (decompressed ahead in a thread), and so sharded by file.
"""
from __future__ import annotations

import csv
import io
import re
import threading
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import torch

from deeprec.data import fs, ranged
from deeprec.data.reader import BatchReader, resolve_paths
from deeprec.data.schema import Schema, check_values, parse_numbers
from deeprec.errors import DataError

CHUNK_BYTES = 4 << 20
PARSE_BLOCK_BYTES = 1 << 20  # Arrow's parse block: in cache, and the unit its threads share out


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


BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, as Excel and many Windows exports begin a file


def detect_layout(path: str, schema: Schema, version=None) -> FileLayout:
    """The delimiter and whether the first line is a header, checked against the schema (a UTF-8 BOM
    before the first line is not part of it). `version`: the file's version first seen."""
    first = fs.first_line(path, version)
    if first.startswith(b"\x1f\x8b") and fs.compression(path) is None:
        raise DataError("gzip-compressed data in a file whose name does not end .gz: name it *.gz to read it "
                        "as a compressed stream (or decompress it: gunzip -k FILE)", path)
    bom = len(BOM) if first.startswith(BOM) else 0
    text = first[bom:].decode("utf-8", errors="replace").rstrip("\r\n")
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
        return FileLayout(delimiter, expected, bom)
    missing = [n for n in schema.names if n not in fields]
    if missing:
        raise DataError(f"header lacks column(s) {', '.join(missing)}; the {schema.name} schema declares "
                        f"{summarize_names(schema.names)}", path, 1)
    return FileLayout(delimiter, tuple(fields), len(first))


def count_lines_before(path: str, offset: int, version=None) -> int:
    """Number of newlines in the first `offset` bytes (for error locations)."""
    count = 0
    with fs.open_stream(path, version) as f:  # compressed files: offsets are in the decompressed content
        while offset > 0:
            block = f.read(min(offset, 16 << 20))
            if not block:
                break
            count += block.count(b"\n")
            offset -= len(block)
    return count


def iter_stream_chunks(path: str, data_start: int, chunk_bytes: int = CHUNK_BYTES,
                       version=None) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) chunks of whole lines of the (decompressed) content past `data_start`."""
    pos, carry = 0, b""
    for block in fs.iter_blocks(path, chunk_bytes, first=version):
        if pos + len(carry) + len(block) <= data_start:  # the header
            pos += len(block)
            continue
        buf = carry + block
        if pos < data_start:
            buf, pos = buf[data_start - pos:], data_start
        newline = buf.rfind(b"\n")
        if newline == -1:
            carry = buf
            continue
        yield pos, buf[:newline + 1]
        pos, carry = pos + newline + 1, buf[newline + 1:]
    if carry:
        yield pos, carry


def _iter_remote_line_chunks(path: str, start: int, end: int, data_start: int,
                             chunk_bytes: int, version=None) -> Iterator[tuple[int, bytes]]:
    """iter_line_chunks over ranged reads fetched ahead in a thread (deeprec.data.fs.iter_range_blocks)."""
    pos = max(start, data_start)
    if pos >= end:
        return
    aligned = pos == data_start  # else the first line beginning at or after `start` is found first
    first = pos if aligned else pos - 1
    carry, pos = b"", first
    for offset, block in fs.iter_range_blocks(path, first, end, max(chunk_bytes, 64 << 10), first=version):
        buf = carry + block if carry else block
        if not aligned:
            newline = buf.find(b"\n")
            if newline == -1:  # still inside the line that began before `start`
                pos, carry = offset + len(block), b""
                continue
            buf, pos, aligned = buf[newline + 1:], pos + newline + 1, True
            if pos >= end:
                return
        if pos + len(buf) >= end:  # the last line begins before `end`: finish it
            newline = buf.find(b"\n", end - 1 - pos)
            if newline != -1:
                yield pos, buf[:newline + 1]
                return
            carry = buf
            continue
        newline = buf.rfind(b"\n")
        if newline == -1:  # a line longer than a block
            carry = buf
            continue
        yield pos, buf[:newline + 1]
        pos, carry = pos + newline + 1, buf[newline + 1:]
    if carry:  # the object's unterminated tail
        yield pos, carry


def iter_line_chunks(path: str, start: int, end: int, data_start: int,
                     chunk_bytes: int = CHUNK_BYTES, version=None) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) chunks holding exactly the lines that begin in [start, end), of the file's
    `version` when given (deeprec.data.ranged: another version is a ChangedError)."""
    if fs.is_url(path):
        yield from _iter_remote_line_chunks(path, start, end, data_start, chunk_bytes, version)
        return
    with fs.open_ranged(path, first=version) as f:
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
        self._versions = ranged.versions(self.paths)  # each file read as the version seen now
        self._layouts = {p: detect_layout(p, schema, self._versions[p]) for p in self.paths}
        self._sizes = {p: self._versions[p].size for p in self.paths if fs.compression(p) is None}
        self.check_nonempty()

    def _all_units(self) -> list:
        # Each file is cut into num_shards byte ranges; range k is unit k of the file,
        # so by the base class's round-robin rule it belongs to shard k.
        units = []
        for path in self.paths:
            if fs.compression(path):  # a stream: one unit, the whole file
                units.append((path, 0, None))
                continue
            layout = self._layouts[path]
            size = self._sizes[path]
            body = max(size - layout.data_start, 0)
            bounds = [layout.data_start + body * k // self.num_shards for k in range(self.num_shards + 1)]
            units.extend((path, bounds[k], bounds[k + 1]) for k in range(self.num_shards))
        return units

    def _unit_has_rows(self, unit) -> bool:
        """Whether a line begins in the byte range (reads one line, as iter_line_chunks does)."""
        path, start, end = unit
        if end is None:
            return True
        data_start = self._layouts[path].data_start
        pos = max(start, data_start)
        if pos > data_start and pos < end:
            with fs.open_ranged(path, block=64 << 10, first=self._versions[path]) as f:
                f.seek(pos - 1)
                pos = pos - 1 + len(f.readline())
        return pos < end

    def _capacity(self) -> tuple[int, str]:
        # estimated from each file's first row: a byte range at least a row long starts a row
        best, row_bytes = 0, 0
        streams = sum(1 for p in self.paths if fs.compression(p))
        for path in self.paths:
            if fs.compression(path):
                continue
            start = self._layouts[path].data_start
            with fs.open_ranged(path, block=64 << 10, first=self._versions[path]) as f:
                f.seek(start)
                first = len(f.readline())
            if first:
                body = self._sizes[path] - start
                if body // first >= best:
                    best, row_bytes = body // first, first
        compressed = (f"compressed files (.gz, .zst, .bz2) cannot be cut by bytes, so they are sharded by file: "
                      f"{streams} compressed file(s) give at most {streams} shard(s)")
        if streams == len(self.paths):
            return streams, compressed
        text = (f"text files are cut into byte ranges and a row is about {row_bytes} bytes, so the data "
                f"gives about {best} shard(s)")
        return best + streams, text if not streams else f"{text}; {compressed}"

    def _unit_words(self) -> str:
        if all(fs.compression(p) for p in self.paths):
            return "compressed files are read whole, one file per unit"
        return "text byte ranges, or whole compressed files"

    def _read_unit(self, unit) -> Iterator[pa.Table]:
        path, start, end = unit
        layout = self._layouts[path]
        version = self._versions[path]
        if end is None:
            for offset, chunk in iter_stream_chunks(path, layout.data_start, self.chunk_bytes, version):
                yield self._parse_chunk(path, layout, offset, chunk)
            return
        for offset, chunk in iter_line_chunks(path, start, end, layout.data_start, self.chunk_bytes, version):
            yield self._parse_chunk(path, layout, offset, chunk)

    # -- parsing ---------------------------------------------------------------
    def _parse_chunk(self, path: str, layout: FileLayout, offset: int, chunk: bytes) -> pa.Table:
        schema = self.schema
        wrong_width: list[tuple[int, int]] = []  # (field count, physical lines) of rows pyarrow rejected

        def on_invalid(row):
            wrong_width.append((row.actual_columns, row.text.count("\n") + 1))
            return "skip"

        # Blocks of 1 MiB (in cache; on Arrow's threads where the budget allows: a 4 MiB chunk 19.9 -> 9.4 ms
        # on 2 cores) only where no quote can open a field: a quoted field may hold a newline, where Arrow's
        # block splitter would cut a row (rows swallowed, or the parse out of sync). TSV has no quoting.
        blocks = _quote_char(layout) is False or b'"' not in chunk

        def read(types, threads: bool = False):
            del wrong_width[:]
            return pacsv.read_csv(
                io.BytesIO(chunk),
                read_options=pacsv.ReadOptions(column_names=list(layout.names), use_threads=threads and blocks,
                                               block_size=PARSE_BLOCK_BYTES if blocks else len(chunk) + 1),
                parse_options=pacsv.ParseOptions(delimiter=layout.delimiter, invalid_row_handler=on_invalid,
                                                 quote_char=_quote_char(layout)),
                convert_options=pacsv.ConvertOptions(column_types=types, include_columns=list(schema.names),
                                                     strings_can_be_null=False, quoted_strings_can_be_null=False),
            )

        locator = _Locator(path, layout, offset, chunk, self._versions.get(path))
        try:
            table = read(schema.arrow_types(strict=True), threads=_arrow_threads())
            if wrong_width:  # rows that do not fit, located one thread alone: in file order
                table = read(schema.arrow_types(strict=True))
            bad, valid = [], None
        except pa.ArrowInvalid:  # a non-number (or non-UTF-8 bytes) somewhere: validate value by value
            try:
                table, bad, valid = _validate_numbers(read(schema.arrow_types(strict=False)), schema)
            except pa.ArrowInvalid as err:  # what even a bytes read refuses: the chunk, located
                raise DataError(f"cannot parse ({err})", path, locator.first_line()) from None
        problems = [(lambda k=k: locator.bad_width_line(k), _width_reason(len(layout.names), w, lines), lines)
                    for k, (w, lines) in enumerate(wrong_width)]
        reasons = dict(bad)
        label_ok = check_values(schema, table, reasons)
        if label_ok is not None:
            valid = label_ok if valid is None else pc.and_(valid, label_ok)
        if valid is not None and not pc.all(valid).as_py():
            for row in np.flatnonzero(~valid.to_numpy(zero_copy_only=False)):
                problems.append((lambda row=int(row): locator.data_row_line(row), reasons[int(row)], 1))
            table = table.filter(valid)
        if problems:
            self._report(path, problems)
        return table


def _validate_numbers(table: pa.Table, schema: Schema):
    """Cast numeric text columns to their types, marking values that are not numbers."""
    valid = None
    bad: list[tuple[int, str]] = []
    for column in schema.numeric_columns():
        typed, ok, reasons = parse_numbers(table.column(column.name), column)
        bad += reasons
        table = table.set_column(table.schema.get_field_index(column.name), column.name, typed)
        valid = ok if valid is None else pc.and_(valid, ok)
    bad.sort()
    return table, bad, valid


def _arrow_threads() -> bool:
    """Whether a parse may use Arrow's thread pool: on the main thread where its torch budget has more than one
    core (a reader inline in the training loop). A SmartStage thread, a DataLoader worker or any other thread
    reads on its own: background threads plus the step's stay within the cores."""
    return threading.current_thread() is threading.main_thread() and torch.get_num_threads() > 1


def _quote_char(layout: FileLayout):
    """TSV has no quoting (Criteo's fields may start with a lone '"'); CSV quotes with '"'."""
    return False if layout.delimiter == "\t" else '"'


def _width_reason(expected: int, found: int, lines: int) -> str:
    if lines > 1:  # an opening quote never closed: pyarrow read the following lines into this row
        return f"unbalanced quote: {lines} lines read as one row of {found} fields (all {lines} counted bad)"
    return f"expected {expected} fields, found {found}"


class _Locator:
    """Maps a row of a chunk back to its physical line number (error path only).

    Records are split as pyarrow splits them (csv module, same delimiter and quoting),
    so a quoted field holding the delimiter or a newline does not shift the count."""

    def __init__(self, path, layout, offset, chunk, version=None):
        self.path, self.layout, self.offset, self.chunk, self.version = path, layout, offset, chunk, version
        self._rows = None

    def first_line(self) -> int:
        return count_lines_before(self.path, self.offset, self.version) + 1

    def _classify(self):
        if self._rows is None:
            base = self.first_line()
            width = len(self.layout.names)
            good, wrong = [], []
            quote = _quote_char(self.layout)
            lines = io.StringIO(self.chunk.decode("latin-1"), newline="")  # one char per byte: lines kept
            reader = csv.reader(lines, delimiter=self.layout.delimiter, quotechar=quote or None,
                                quoting=csv.QUOTE_MINIMAL if quote else csv.QUOTE_NONE)
            start = 0  # physical lines consumed before this record
            for record in reader:
                first, start = base + start, reader.line_num
                if record in ([], [""]) or (len(record) == 1 and not record[0].strip("\r")):
                    continue  # pyarrow skips empty lines
                (good if len(record) == width else wrong).append(first)
            self._rows = (good, wrong)
        return self._rows

    def data_row_line(self, row: int):
        good = self._classify()[0]
        return good[row] if row < len(good) else None

    def bad_width_line(self, k: int):
        wrong = self._classify()[1]
        return wrong[k] if k < len(wrong) else None
