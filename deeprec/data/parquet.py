"""Parquet input with the same raw batches as the CSV readers, for any schema (Criteo's by default).

Units are (file, row group), dealt round-robin to shards; each row group is
streamed in record batches, so memory stays bounded by the row-group reads.
Numeric columns are cast to float32; string categoricals of any type reach
`forward` as bytes (integers written in decimal); sequences may be list columns
or delimited strings.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from deeprec.data import fs, ranged
from deeprec.data.criteo import CRITEO_SCHEMA
from deeprec.data.reader import BatchReader, Place, resolve_paths
from deeprec.data.schema import Schema, check_values, parse_numbers
from deeprec.data.tables import partition_values
from deeprec.errors import DataError
from deeprec.ragged import Ragged

READ_ROWS = 65536


class ParquetReader(BatchReader):
    """Streaming Parquet reader; same arguments and batches as `CriteoReader`."""

    def __init__(self, paths, batch_size: int, *, columns: Schema = CRITEO_SCHEMA, **kwargs):
        super().__init__(resolve_paths(paths), batch_size, columns, **kwargs)  # self.columns: a Schema
        self._row_groups = {}
        self._partitions = {}  # path -> {column: value} the schema takes from its key=value folders
        self._versions = ranged.versions(self.paths)  # each file read as the version seen now
        for path in self.paths:
            try:
                handle = fs.open_parquet(path, self._versions[path])
                meta = handle.metadata
            except (pa.ArrowInvalid, OSError) as err:
                _raise_if_changed(err, path, self._versions[path])
                raise DataError(f"not a readable Parquet file ({err})", path) from err
            names = set(handle.schema_arrow.names)  # top-level names (a list column's leaf is "element")
            self._partitions[path] = self._check_columns(path, names)
            starts = np.concatenate([[0], np.cumsum([meta.row_group(i).num_rows
                                                     for i in range(meta.num_row_groups)])])
            self._row_groups[path] = starts
        self.check_nonempty()

    def _all_units(self) -> list:
        return [(path, group) for path in self.paths for group in range(len(self._row_groups[path]) - 1)]

    def _unit_has_rows(self, unit) -> bool:
        path, group = unit
        return bool(self._row_groups[path][group + 1] > self._row_groups[path][group])

    def _capacity(self) -> tuple[int, str]:
        groups = sum(map(self._unit_has_rows, self._all_units()))
        where = "the file has" if len(self.paths) == 1 else "the files have"
        return groups, (f"Parquet is sharded by row group and {where} {groups} row group(s) with rows, so it gives "
                        f"at most {groups} shard(s) (write smaller row groups for more)")

    def _read_unit(self, unit) -> Iterator[pa.Table]:
        path, group = unit
        group_rows = int(self._row_groups[path][group + 1] - self._row_groups[path][group])
        done = 0
        try:
            reader = fs.open_parquet(path, self._versions[path])
            batches = reader.iter_batches(batch_size=READ_ROWS, row_groups=[group],
                                          columns=self._file_columns(path), use_threads=False)
            for batch in batches:
                table = self._with_partitions(path, pa.Table.from_batches([batch]))
                done += batch.num_rows
                yield self._conform(path, group, done - batch.num_rows, table)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as err:  # a corrupt page or file
            _raise_if_changed(err, path, self._versions[path])
            lost = group_rows - done  # the rest of the row group cannot be decoded: each row is bad
            self._report(path, [(lambda: self._where(group, done), f"cannot decode the rest of row group {group} "
                                 f"({lost} rows): {err}", lost)])

    # -- columns from the file's partition folders (Hive tables) -----------------------------
    def _check_columns(self, path: str, names) -> dict:
        """The schema's columns that `path` lacks, taken from its key=value folders
        (strings; the schema's kind casts them); any other missing column is a DataError."""
        missing = [c for c in self.columns.names if c not in names]
        folders = partition_values(path) if missing else {}
        absent = [c for c in missing if c not in folders]
        if absent:
            raise DataError(f"missing column(s) {', '.join(absent)}", path)
        return {c: folders[c] for c in missing}

    def _file_columns(self, path: str) -> list:
        return [c for c in self.columns.names if c not in self._partitions[path]]

    def _with_partitions(self, path: str, table: pa.Table) -> pa.Table:
        for name, value in self._partitions[path].items():
            col = pa.nulls(table.num_rows, pa.string()) if value is None else pa.repeat(pa.scalar(value), table.num_rows)
            table = table.append_column(name, col)
        return table

    @staticmethod
    def _where(group: int, row: int) -> Place:
        return Place("row group", group, row)

    def _conform(self, path: str, group: int, first_row: int, table: pa.Table) -> pa.Table:
        """The schema's types; a value that does not fit is a bad row (file:row group:row)."""
        schema, columns, reasons, valid = self.columns, {}, {}, None
        for c in schema.columns:
            if c.kind == "ignore":
                continue
            col = table.column(c.name)
            text = pa.types.is_string(col.type) or pa.types.is_binary(col.type) or pa.types.is_large_string(col.type)
            numeric = c.kind in ("label", "dense", "weight") or (c.kind == "categorical" and c.dtype == "int")
            try:
                if numeric and text:  # numbers written as text: value by value, like the CSV reader
                    col, ok, bad = parse_numbers(col, c)
                    for row, reason in bad:
                        reasons.setdefault(row, reason)
                    valid = ok if valid is None else pc.and_(valid, ok)
                elif numeric:
                    col = pc.cast(col, pa.int64() if c.kind == "categorical" else pa.float32())
                elif c.kind == "categorical":  # sequences are split later (split_sequence)
                    if not (pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type)):
                        col = pc.cast(col, pa.string())
                    col = pc.fill_null(pc.cast(col, pa.binary()), b"")
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
                raise DataError(f"column {c.name} of type {col.type} does not fit the schema's "
                                f"{c.kind} ({c.dtype}) ({err})", path) from err
            columns[c.name] = col
        table = pa.table(columns)
        checked = check_values(schema, table, reasons)
        if checked is not None:
            valid = checked if valid is None else pc.and_(valid, checked)
        if valid is not None and not pc.all(valid).as_py():
            bad_rows = np.flatnonzero(~valid.to_numpy(zero_copy_only=False))
            self._report(path, [(lambda r=int(r): self._where(group, first_row + r), reasons[int(r)], 1)
                                for r in bad_rows])
            table = table.filter(valid)
        return table


def _raise_if_changed(err: BaseException, path: str, version) -> None:
    """The store's "not the version opened" (S3's If-Match refused) as a ChangedError, not a corrupt file."""
    if ranged.is_expired(err):
        raise ranged.changed(path, version) from None


def _arrow(value) -> pa.Array:
    if isinstance(value, Ragged):
        offsets = pa.array(value.offsets.numpy().astype(np.int32), pa.int32())
        if value.is_strings:
            return pa.Array.from_buffers(pa.binary(), value.rows, [None, offsets.buffers()[1],
                                                                   pa.py_buffer(value.values.numpy())])
        items = _arrow(value.values) if isinstance(value.values, Ragged) else pa.array(value.values.numpy())
        return pa.ListArray.from_arrays(offsets, items)
    return pa.array(value.numpy())


def write_parquet(reader: BatchReader, path: str, row_group_rows: int = 100_000) -> int:
    """Write every batch of `reader` to one Parquet file (strings as binary)."""
    writer = None
    rows = 0
    try:
        for batch in reader:
            cols = {name: _arrow(value) for name, value in batch.items()}
            table = pa.table(cols)
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema)
            writer.write_table(table, row_group_size=row_group_rows)
            rows += table.num_rows
    finally:
        if writer is not None:
            writer.close()
    return rows
