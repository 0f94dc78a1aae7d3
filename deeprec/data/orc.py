"""ORC input (Hive / ODPS tables) with the same raw batches as the CSV and Parquet readers.

Units are (file, stripe), dealt round-robin to shards as Parquet's row groups are; a
stripe is read whole (`pyarrow.orc.ORCFile.read_stripe`, 64 MB by default, so memory
stays bounded by the stripe) and handed on in slices. Types are conformed to the schema
as `ParquetReader` does (same bad-row policy; a bad value is located as
`path:stripe S:row R`, R 0-based within the stripe), and a column the schema names
that the file lacks comes from the path's `key=value` partition folders, or is named.
"""
from __future__ import annotations

from typing import Iterator

import pyarrow as pa

from deeprec.data.criteo import CRITEO_SCHEMA
from deeprec.data import ranged
from deeprec.data.parquet import READ_ROWS, ParquetReader, _raise_if_changed
from deeprec.data.reader import BatchReader, Place, resolve_paths
from deeprec.data.schema import Schema
from deeprec.errors import DataError


def open_orc(path: str, version=None):
    """A pyarrow ORCFile; a URL (s3://, hdfs://, file://, ...) through its fsspec filesystem; of the
    file's `version` when given (another is a ChangedError)."""
    import pyarrow.orc as orc

    from deeprec.data.ranged import open_pinned

    return orc.ORCFile(open_pinned(path, version))


class OrcReader(ParquetReader):
    """Streaming ORC reader; same arguments and batches as `ParquetReader` and `CriteoReader`."""

    def __init__(self, paths, batch_size: int, *, columns: Schema = CRITEO_SCHEMA, **kwargs):
        BatchReader.__init__(self, resolve_paths(paths), batch_size, columns, **kwargs)
        self._stripes = {}  # path -> number of stripes
        self._rows = {}  # path -> number of rows
        self._partitions = {}
        self._versions = ranged.versions(self.paths)  # each file read as the version seen now
        for path in self.paths:
            try:
                handle = open_orc(path, self._versions[path])
                self._stripes[path], self._rows[path] = handle.nstripes, handle.nrows
                names = set(handle.schema.names)
            except (pa.ArrowInvalid, OSError) as err:
                _raise_if_changed(err, path, self._versions[path])
                raise DataError(f"not a readable ORC file ({err})", path) from err
            self._partitions[path] = self._check_columns(path, names)
        self.check_nonempty()

    def _all_units(self) -> list:
        return [(path, stripe) for path in self.paths for stripe in range(self._stripes[path])]

    def _unit_has_rows(self, unit) -> bool:
        return self._rows[unit[0]] > 0  # ORC writes no empty stripe; stripe row counts are not in the footer

    def _capacity(self) -> tuple[int, str]:
        stripes = sum(map(self._unit_has_rows, self._all_units()))
        where = "the file has" if len(self.paths) == 1 else "the files have"
        return stripes, (f"ORC is sharded by stripe and {where} {stripes} stripe(s), so it gives at most "
                         f"{stripes} shard(s) (write smaller stripes for more)")

    def _unit_words(self) -> str:
        return "ORC stripes"

    @staticmethod
    def _where(stripe: int, row: int) -> Place:
        """An ORC row's place: stripe, then 0-based row within it."""
        return Place("stripe", stripe, row)

    def _read_unit(self, unit) -> Iterator[pa.Table]:
        path, stripe = unit
        try:
            batch = open_orc(path, self._versions[path]).read_stripe(stripe, columns=self._file_columns(path))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as err:  # a corrupt stripe or file
            _raise_if_changed(err, path, self._versions[path])
            self._report(path, [(lambda: self._where(stripe, 0), f"cannot decode stripe {stripe}: {err}", 1)])
            return
        table = self._with_partitions(path, pa.Table.from_batches([batch]))
        for start in range(0, table.num_rows, READ_ROWS):
            yield self._conform(path, stripe, start, table.slice(start, READ_ROWS))


def write_orc(reader: BatchReader, path: str, stripe_rows: int = 100_000, compression: str = "snappy") -> int:
    """Write every batch of `reader` to one ORC file (strings as binary; snappy as Parquet's default),
    in stripes of `stripe_rows` rows: the units ORC data is sharded by. (Compressed, a stripe is cut
    only once a compression block has filled: a file of a few thousand rows may be one stripe.)"""
    import pyarrow.orc as orc

    from deeprec.data.parquet import _arrow
    from deeprec.data.reader import _rebatch

    writer = None
    rows = 0
    try:
        tables = (pa.table({name: _arrow(value) for name, value in batch.items()}) for batch in reader)
        for table in _rebatch(tables, stripe_rows, drop_remainder=False):
            if writer is None:  # it cuts a stripe after each batch_size rows once past stripe_size (1 byte)
                writer = orc.ORCWriter(path, batch_size=stripe_rows, stripe_size=1, compression=compression)
            writer.write(table)
            rows += table.num_rows
    finally:
        if writer is not None:
            writer.close()
    return rows
