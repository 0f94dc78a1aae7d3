"""Shared machinery of the batch readers: sharding units, shuffle, batching,
bad-row policy, resumable position.

    units of this shard --> read_unit (Arrow tables, valid rows only)
        --> shuffle buffer (optional) --> batch_size row ranges of merged tables
        --> each table converted to tensors once (ChunkBatches) --> raw batch dicts, views of its rows

A subclass says which units exist (`_all_units`) and how to read one
(`_read_unit`); everything else lives here, so every reader has the same
exactly-once, determinism and error guarantees.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np
import pyarrow as pa
import torch.utils.data

from deeprec.data.chunk_batches import ChunkBatches
from deeprec.errors import ConfigError, DataError, EmptyShardError, check_choice

log = logging.getLogger("deeprec.data")

BAD_ROW_POLICIES = ("raise", "skip")
MAX_LOGGED_BAD_ROWS = 5


class Place(NamedTuple):
    """A row's place in a file of units (Parquet's row groups, ORC's stripes): `row group 3:row 7`.
    Places sort by (unit, row) as numbers, so the first bad row of a chunk is the one named."""

    unit_word: str
    unit: int
    row: int

    def __str__(self) -> str:
        return f"{self.unit_word} {self.unit}:row {self.row}"


@dataclass
class ReaderStats:
    rows: int = 0  # valid rows yielded
    batches: int = 0
    bad_rows: int = 0
    bad_row_examples: list = field(default_factory=list)  # "path:line: reason", first few


class BatchReader(torch.utils.data.IterableDataset):
    """Base class; see `CriteoReader` and `ParquetReader`.

    Also a torch `IterableDataset`: `DataLoader(reader, batch_size=None, num_workers=k)`
    reads in k worker processes, each taking every k-th unit of this reader's shards
    (every row still read exactly once); `deeprec.data.collate` merges batches when a
    DataLoader groups several (batch_size=n). A DataLoader's workers hold their own
    reader copies, so resume positions (`state_dict`) are tracked only without one.
    """

    def __init__(self, paths, batch_size: int, columns, *, shuffle_buffer: int = 0,
                 seed: int = 0, num_epochs: int | None = 1, shard_index: int = 0,
                 num_shards: int = 1, on_bad_row: str = "raise", drop_remainder: bool = False):
        check_choice("on_bad_row", on_bad_row, BAD_ROW_POLICIES)
        if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__"):
            paths = [paths]
        self.paths = [str(p) for p in paths]
        if not self.paths:
            raise ConfigError("paths is empty: give at least one file")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive int, got {batch_size!r}")
        shards = (shard_index,) if isinstance(shard_index, int) else tuple(sorted(set(shard_index)))
        if num_shards < 1 or not shards or not all(0 <= s < num_shards for s in shards):
            raise ConfigError(f"shard_index must be in [0, num_shards={num_shards}) (an int or a list "
                              f"of them), got {shard_index!r}")
        if num_epochs is not None and num_epochs < 1:
            raise ConfigError(f"num_epochs must be >= 1 or None (repeat forever), got {num_epochs}")
        if shuffle_buffer < 0:
            raise ConfigError(f"shuffle_buffer must be >= 0, got {shuffle_buffer}")
        self.batch_size = batch_size
        self.columns = columns  # a deeprec.data.Schema
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.num_epochs = num_epochs
        self.shard_index = shard_index
        self.shards = shards
        self.num_shards = num_shards
        self.on_bad_row = on_bad_row
        self.drop_remainder = drop_remainder
        self.stats = ReaderStats()
        # None: an error in a file ends the iteration. A dict (--follow sets one): a DataError from a file's
        # content quarantines the file instead, `quarantined[path] = the error`, the rest of it unread,
        # and `on_quarantine(path, error)` is told; the other files are read on.
        self.quarantined: dict[str, str] | None = None
        self.on_quarantine: Callable[[str, DataError], None] | None = None
        self._epoch = 0
        self._batches_in_epoch = 0
        self._unit_pos: tuple[int, int] | None = (0, 0)  # without shuffle: (unit of this epoch, its rows done)

    # -- subclass interface -------------------------------------------------
    def _all_units(self) -> list:
        """Every unit of work over all files, in a fixed order."""
        raise NotImplementedError

    def _shard_units(self) -> list:
        """The units of this reader's shards: unit i belongs to shard i % num_shards."""
        units = [u for i, u in enumerate(self._all_units()) if i % self.num_shards in self.shards]
        worker = torch.utils.data.get_worker_info()
        if worker is not None and worker.num_workers > 1:  # inside a DataLoader: split among its workers
            if worker.id >= len(units):  # idle, and said so (compressed files are one unit each)
                warnings.warn(f"DataLoader worker {worker.id} of {worker.num_workers} has nothing to read: this "
                              f"reader's shard holds {len(units)} unit(s) ({self._unit_words()}); use num_workers "
                              f"<= {max(len(units), 1)} or more files", RuntimeWarning, stacklevel=2)
            units = units[worker.id::worker.num_workers]
        return units

    def _unit_words(self) -> str:
        """What a unit is, for messages."""
        return "byte ranges or row groups"

    def _read_unit(self, unit) -> Iterator[pa.Table]:
        """Valid rows of one unit as tables with columns `self.columns.names`."""
        raise NotImplementedError

    def _unit_has_rows(self, unit) -> bool:
        """Whether a unit holds any row, from metadata or a few bytes (True when unknown)."""
        return True

    def _capacity(self) -> tuple[int, str]:
        """How many shards the files can be cut into, and a sentence saying why (EmptyShardError)."""
        units = sum(map(self._unit_has_rows, self._all_units()))
        return units, f"the data has {units} unit(s) with rows, one per shard"

    # -- early checks -------------------------------------------------------------
    def check_nonempty(self) -> None:
        """Raise EmptyShardError when this reader's shards own no rows while the files hold some
        (more shards than the data can be cut into), before anything trains on the other shards.
        Cheap: Parquet metadata, one line per text byte range. Files with no rows at all are left
        to iteration, which names them ("no data rows")."""
        if self.num_shards == 1:
            return
        units = self._all_units()
        if any(self._unit_has_rows(u) for i, u in enumerate(units) if i % self.num_shards in self.shards):
            return
        if not any(self._unit_has_rows(u) for u in units):
            return
        capacity, why = self._capacity()
        shard = (f"shard {self.shard_index} of {self.num_shards} holds" if isinstance(self.shard_index, int)
                 else f"shards {', '.join(map(str, self.shards))} of {self.num_shards} hold")
        raise EmptyShardError(f"{', '.join(self.paths)}: {shard} no rows: {why}; use num_shards <= "
                              f"{max(capacity, 1)} or more files", paths=self.paths, shard_index=self.shard_index,
                              num_shards=self.num_shards, max_shards=capacity)

    # -- bad rows -------------------------------------------------------------
    def _report(self, path: str, problems: list) -> None:
        """Apply the bad-row policy to one chunk's problems: (locate, reason, rows)
        triples, where `locate()` finds the line lazily (it may rescan the file), so it
        runs only when a line is reported, and `rows` is how many rows the problem spoils."""
        def located():
            return sorted(((locate(), reason) for locate, reason, _ in problems),
                          key=lambda item: (item[0] is None, item[0] or 0))

        if self.on_bad_row == "raise":
            line, reason = located()[0]
            raise DataError(reason, path, line)
        self.stats.bad_rows += sum(rows for _, _, rows in problems)
        room = MAX_LOGGED_BAD_ROWS - len(self.stats.bad_row_examples)
        if room <= 0:
            return
        for line, reason in located()[:room]:
            example = f"{path}:{line if line is not None else '?'}: {reason}"
            self.stats.bad_row_examples.append(example)
            log.warning("skipping bad row %s", example)
        if len(self.stats.bad_row_examples) == MAX_LOGGED_BAD_ROWS:
            log.warning("further bad rows are skipped and counted in reader.stats.bad_rows")

    # -- position ---------------------------------------------------------------
    def state_dict(self) -> dict:
        """Position after the last batch yielded; restore with `load_state_dict`."""
        state = {"epoch": self._epoch, "batches": self._batches_in_epoch, "fingerprint": self._fingerprint()}
        if self.shuffle_buffer == 0 and self._unit_pos is not None:  # resume reads from here, not from the start
            state["unit"], state["unit_rows"] = self._unit_pos
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("fingerprint") != self._fingerprint():
            raise ConfigError(
                "reader state was saved with other reader settings "
                f"(saved {state.get('fingerprint')}, now {self._fingerprint()}); "
                "resume with the same paths, batch_size, seed, shuffle_buffer and sharding")
        self._epoch = int(state["epoch"])
        self._batches_in_epoch = int(state["batches"])
        self._unit_pos = (int(state["unit"]), int(state["unit_rows"])) if "unit" in state else None

    def _fingerprint(self) -> list:
        return [self.paths, self.batch_size, self.seed, self.shuffle_buffer,
                list(self.shards), self.num_shards, self.drop_remainder]

    # -- iteration ---------------------------------------------------------------
    def __iter__(self) -> Iterator[dict]:
        """Yield raw batches from the current position to the last epoch.

        Without a shuffle buffer the position is (unit, rows of it done): resuming starts reading
        at that unit (a compressed file, a byte range, a row group) and drops the rows done, so
        nothing before it is read again. With a shuffle buffer (or a state saved without the unit)
        resuming replays the epoch's deterministic order and skips the batches already consumed.
        Either way the stream continues exactly where it stopped.
        """
        while self.num_epochs is None or self._epoch < self.num_epochs:
            skip = self._batches_in_epoch
            rng = np.random.default_rng([self.seed, self._epoch, *self.shards])
            units = self._shard_units()
            if self.shuffle_buffer > 0:
                units = [units[i] for i in rng.permutation(len(units))]
            seen = {"rows": 0, "bad": self.stats.bad_rows}  # this epoch's valid rows and bad rows
            track = self.shuffle_buffer == 0 and not _in_split_worker()
            first, done = (0, 0)
            if track and skip and self._unit_pos is not None:  # fast-forward to the unit
                first, done = self._unit_pos
                if first >= len(units):
                    raise ConfigError(f"reader state points past the end of epoch {self._epoch}")
                skip = 0
            starts: list[tuple[int, int]] = []  # (unit, rows of this epoch's stream before it)
            tables = self._unit_tables(units, first, done, seen, starts)
            if self.shuffle_buffer > 0:
                tables = _shuffle(tables, self.shuffle_buffer, rng)
            yielded = self._batches_in_epoch > 0 and not skip  # batches before the position were yielded
            position = done  # rows of the stream through the last batch
            chunk = None  # the table being cut into batches, converted once (at its first batch not skipped)
            for table, start, stop in _batch_ranges(tables, self.batch_size, self.drop_remainder):
                yielded = True
                position += stop - start
                if skip:
                    skip -= 1
                    continue
                if chunk is None or chunk.table is not table:
                    chunk = ChunkBatches(self.columns, table)
                batch = self._to_batch(chunk, start, stop)
                self._batches_in_epoch += 1
                self.stats.batches += 1
                self.stats.rows += stop - start
                if track:
                    while len(starts) > 1 and starts[1][1] < position:
                        starts.pop(0)
                    self._unit_pos = (starts[0][0], position - starts[0][1])
                else:
                    self._unit_pos = None
                yield batch
            if skip:
                raise ConfigError(f"reader state points past the end of epoch {self._epoch}")
            if not yielded and not _in_split_worker():  # another epoch would yield none either: never loop
                raise DataError(self._no_batch_reason(seen["rows"], self.stats.bad_rows - seen["bad"], bool(units)),
                                ", ".join(self.paths))
            self._epoch += 1
            self._batches_in_epoch = 0
            self._unit_pos = (0, 0)

    def _unit_tables(self, units: list, first: int, done: int, seen: dict, starts: list) -> Iterator[pa.Table]:
        """Valid rows of units[first:], the first `done` rows of units[first] dropped; `starts` gets each
        unit's index and its first row's place in the stream (the dropped rows counted)."""
        total = 0
        for index in range(first, len(units)):
            starts.append((index, total))
            drop = done if index == first else 0
            total += drop
            path = units[index][0]
            if self.quarantined is not None and path in self.quarantined:
                continue  # its rows after the error are not read
            try:
                for table in self._read_unit(units[index]):
                    if drop:
                        cut = min(drop, table.num_rows)
                        table, drop = table.slice(cut), drop - cut
                    if table.num_rows:
                        total += table.num_rows
                        yield _counted(table, seen)
            except DataError as err:
                from deeprec.data.ranged import StoreError

                if self.quarantined is None or isinstance(err, StoreError) and not err.missing:
                    raise  # the store itself failing (network, credentials) is no fault of the file
                self.quarantined[path] = str(err)
                if self.on_quarantine is not None:
                    self.on_quarantine(path, err)

    def _no_batch_reason(self, rows: int, bad: int, has_units: bool) -> str:
        if rows and self.drop_remainder:
            return (f"epoch {self._epoch} yields no batch: {rows} valid rows < batch size {self.batch_size} and "
                    "short batches are dropped (a model with batch norm cannot train on them): lower --batch-size")
        if bad:
            return f"no valid rows: all {bad} rows are bad (skipped under on_bad_row='skip')"
        where = f" in shard {self.shard_index} of {self.num_shards}" if self.num_shards > 1 else ""
        if not has_units:
            return f"no data{where}: use fewer shards or more files"
        return f"no data rows{where} (the files hold no rows, or only a header)"

    def _to_batch(self, chunk: ChunkBatches, start: int, stop: int) -> dict:
        """Rows [start, stop) of the converted chunk: the raw batch."""
        return chunk.rows(start, stop)


def _counted(table: pa.Table, seen: dict) -> pa.Table:
    seen["rows"] += table.num_rows
    return table


def _in_split_worker() -> bool:
    """Inside one of several DataLoader workers: a worker may own no unit of the shard."""
    worker = torch.utils.data.get_worker_info()
    return worker is not None and worker.num_workers > 1


def _shuffle(tables: Iterator[pa.Table], size: int, rng: np.random.Generator) -> Iterator[pa.Table]:
    """tf.data-style shuffle buffer, vectorized: every row emitted is drawn
    uniformly from the `size` rows held plus the newly arrived ones."""
    held = None
    for table in tables:
        held = table if held is None else pa.concat_tables([held, table])
        if held.num_rows > size:
            order = rng.permutation(held.num_rows)
            n_out = held.num_rows - size
            yield held.take(order[:n_out])
            held = held.take(order[n_out:])
    if held is not None and held.num_rows:
        yield held.take(rng.permutation(held.num_rows))


def _batch_ranges(tables: Iterator[pa.Table], batch_size: int,
                  drop_remainder: bool) -> Iterator[tuple[pa.Table, int, int]]:
    """(table, start, stop): batch_size rows at a time of the tables' rows, as row ranges of merged
    tables (one per incoming table or WINDOW_ROWS of it, the previous one's remainder ahead of its rows)."""
    pending: list[pa.Table] = []
    pending_rows = 0
    for table in _pieces(tables):
        pending.append(table)
        pending_rows += table.num_rows
        if pending_rows < batch_size:
            continue
        merged = pa.concat_tables(pending).combine_chunks()
        start = 0
        while merged.num_rows - start >= batch_size:
            yield merged, start, start + batch_size
            start += batch_size
        pending = [merged.slice(start)]
        pending_rows = merged.num_rows - start
    if pending_rows and not drop_remainder:
        merged = pa.concat_tables(pending).combine_chunks()
        yield merged, 0, merged.num_rows


WINDOW_ROWS = 1 << 16  # rows converted to tensors at once (a shuffle buffer's table may hold millions)


def _pieces(tables: Iterator[pa.Table]) -> Iterator[pa.Table]:
    for table in tables:
        if table.num_rows <= WINDOW_ROWS:
            yield table
            continue
        for start in range(0, table.num_rows, WINDOW_ROWS):
            yield table.slice(start, WINDOW_ROWS)


def _rebatch(tables: Iterator[pa.Table], batch_size: int, drop_remainder: bool) -> Iterator[pa.Table]:
    for table, start, stop in _batch_ranges(tables, batch_size, drop_remainder):
        yield table.slice(start, stop - start)


PARQUET_SUFFIXES = (".parquet", ".pq")


def resolve_paths(paths: Sequence[str] | str, option: str | None = None) -> list[str]:
    """Expand directories and globs into a sorted list of files, all of one kind (Parquet or text);
    errors start with `option` (the flag that gave the paths) when given. URLs (s3://, gs://, hdfs://,
    file://, any protocol fsspec knows) are expanded by `deeprec.data.fs.expand` and stay URLs."""
    import glob
    import os

    from deeprec.data import fs

    from deeprec.data.tables import file_format, list_remote_table, list_table

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[str] = []
    named = f"{option}: " if option else ""

    def folder(p):
        files = list_table(p)  # a Hive-partitioned table (key=value folders): recursive, partition order
        if files is None:
            files = sorted(os.path.join(p, f) for f in os.listdir(p) if not f.startswith("."))
        if not files:
            raise ConfigError(named + f"directory {p!r} holds no data files (names starting with '.' are ignored)")
        return files
    for p in map(str, paths):
        if fs.is_url(p):  # a remote Hive table's root walked as a local one is, else fs.expand
            out.extend(list_remote_table(p) or fs.expand(p, option))
        elif os.path.isdir(p):
            out.extend(folder(p))
        elif any(ch in p for ch in "*?["):
            matched = sorted(glob.glob(p))
            if not matched:
                raise ConfigError(named + f"no file matches {p!r}")
            for m in matched:  # a glob over partition folders (dt=2026-11-2*) takes their files
                out.extend(folder(m) if os.path.isdir(m) else [m])
        elif os.path.exists(p):
            out.append(p)
        else:
            raise ConfigError(named + f"no such file: {p!r}")
    for f in out:  # a device or a pipe (/dev/zero) never ends: refused before reading
        if not fs.is_url(f) and not os.path.isfile(f):
            raise ConfigError(named + f"{f!r} is not a regular file: give data files, folders of them, or globs")
    formats = {}  # format -> its first file
    for f in out:
        formats.setdefault(file_format(f), f)
    if len(formats) > 1:
        kinds = {"parquet": "Parquet", "orc": "ORC", "text": "text files"}
        mixed = " and ".join(f"{name} ({formats[k]!r})" for k, name in kinds.items() if k in formats)
        raise ConfigError(named + f"the data mixes {mixed}: give one kind "
                          "(a folder or glob of .parquet files, of .orc files, or of CSV/TSV files)")
    return out
