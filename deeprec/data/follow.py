"""`--follow`: continuous training over data that keeps landing (hourly partitions, a log shipper).

    files matching --data, in name order ──> reader over them (one pass) ──> batches
          ▲                                        │ ended
          └── poll every --follow-interval s <─────┘ until files not read yet are complete

A file is taken once its size and modification time held still over one poll, or it is older than
a poll interval (a writer still appending is waited for); names starting with "." or "_" are never taken (Hadoop's and Hive's
temporary and marker files: `_SUCCESS`, `.part-0.crc`). Each file is read once, in name order,
batch after batch across files (the last batch of a set may be short), at the version taken (its
size and tag: ETag, inode; see deeprec/data/ranged.py). The position (files done, the reader's place
in the ones being read, each file's version, the files quarantined) goes into checkpoints, so
`--resume` goes on exactly. The wait ends when the run is asked to stop (`should_stop`, SIGINT/SIGTERM
in the trainer).

A stream without an end is never ended by one file:
- a bad row under `--on-bad-row skip` is skipped and counted, as without --follow;
- under `--on-bad-row raise` (the default), and for a file whose content cannot be read at all under
  either policy (a header lacking a column, not Parquet, a corrupt .gz, changed while being read), the
  file is quarantined: the rows already taken from it stay trained, the rest of it is not read, one
  warning names it and the error's file:line, and the stream goes on. Quarantined files are kept in
  `quarantined` and in checkpoints (never read again). A failing store (network, credentials) still
  ends the run: the trainer checkpoints and says why.
- a file that changes after it was taken (rows appended, or another file renamed over its name) is
  reported, once per change, as a warning naming it; its new rows are not read (a file is read once:
  land new rows as a new file).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Iterator

from deeprec.data import fs, ranged
from deeprec.data.ranged import StoreError, Version
from deeprec.data.reader import ReaderStats, resolve_paths
from deeprec.errors import ConfigError, DataError, DeepRecError

log = logging.getLogger("deeprec.data")


class FollowReader:
    """Reads the files matching `patterns` once each, in name order, and keeps polling for new ones.
    `open_files(files)` opens a one-pass reader over some files (the bad-row policy is its own);
    `owns(path)`: whether this worker reads that file (workers of a job split files, not bytes: each
    sees new files at its own time, so byte-range shares of a changing set would not add up)."""

    def __init__(self, patterns: list[str], open_files: Callable[[list[str]], object], poll_seconds: float = 10.0,
                 should_stop: Callable[[], bool] = lambda: False, owns: Callable[[str], bool] = lambda path: True):
        self.patterns, self.open_files, self.poll_seconds = list(patterns), open_files, poll_seconds
        self.owns = owns  # this worker's files (several workers: each file is one worker's, whole)
        self.should_stop = should_stop
        self.done: list[str] = []  # files read to their end, in order
        self.current: list[str] = []  # files the reader `inner` is reading
        self.quarantined: dict[str, str] = {}  # file -> the error that stopped its reading (never read again)
        self.taken: dict[str, Version] = {}  # each file's version when it was taken (or its last change said)
        self.inner = None
        self.stats = ReaderStats()
        self._sizes: dict[str, Version] = {}  # a candidate's version at the last poll
        self._waiting_on: str | None = None  # why the last look listed nothing (said once)

    def _complete_new_files(self) -> list[str]:
        """Files not yet read whose size and mtime have not changed since the last poll; files already
        taken that changed since are reported."""
        for pattern in self.patterns:  # fsspec caches listings: a new object would stay unseen
            if fs.is_url(pattern):
                fs.filesystem(pattern)[0].invalidate_cache()
        try:
            matched = resolve_paths(self.patterns, "--data")
        except ConfigError as err:  # nothing there yet (a folder emptied, a glob matching none): wait; any
            if str(err) != self._waiting_on:  # other reason (mixed formats, credentials) is said, once
                self._waiting_on = str(err)
                log.warning("--follow: no new files taken, waiting (%s)", err)
            return []
        self._waiting_on = None
        seen = set(self.done) | set(self.current) | set(self.quarantined)
        ready, sizes, now = [], {}, time.time()
        for path in matched:
            if fs.is_hidden(os.path.basename(path)) or not self.owns(path):
                continue
            try:
                version = ranged.version(path)
            except (OSError, DeepRecError):  # removed between the listing and now
                continue
            if path in seen:
                if path not in self.current:
                    self._check_taken(path, version)
                continue
            sizes[path] = version
            old = version.modified is not None and now - version.modified >= self.poll_seconds
            if (path in self._sizes and self._sizes[path].same(version) or old) and version.size > 0:
                ready.append(path)
        self._sizes = sizes
        for path in ready:
            self.taken[path] = sizes[path]
        return sorted(ready)

    def _check_taken(self, path: str, now: Version | None = None) -> None:
        """Warn, once per change, when a file taken earlier is no longer the version taken."""
        first = self.taken.get(path)
        if now is None:
            try:
                now = ranged.version(path, fresh=True)
            except (OSError, DeepRecError):  # removed since: nothing more of it to read or miss
                return
        if first is None:  # taken before a checkpoint that kept no versions: from now on
            self.taken[path] = now
            return
        if first.same(now):
            return
        self.taken[path] = now
        when = "quarantined" if path in self.quarantined else "taken"
        log.warning("--follow: %s %s after it was %s; it is not read again (--follow reads each file once, at the "
                    "version taken: land new rows as a new file)", path, first.change(now), when)

    def _quarantine(self, path: str, err: DataError) -> None:
        self.quarantined[path] = str(err)
        log.warning("--follow: quarantined %s after %s: the rows taken from it before stay trained, the rest of it "
                    "is not read; reading goes on", path, err)

    def _open(self, files: list[str], state: dict | None = None) -> None:
        while files:
            try:
                self.inner = self.open_files(files)
                break
            except DataError as err:  # a file whose content cannot be read at all: quarantined, the rest opened
                bad = next((f for f in files if fs.redact(f) == err.path), None)
                if bad is None or isinstance(err, StoreError) and not err.missing:
                    raise
                self._quarantine(bad, err)
                files = [f for f in files if f != bad]
                if state is not None:  # resuming: the position saved was in the set with that file
                    log.warning("--follow: the files read with %s are read again from their start: %s", bad,
                                ", ".join(files) or "none")
                    state = None
        self.current = files
        if not files:
            self.inner = None
            return
        if hasattr(self.inner, "quarantined"):
            self.inner.quarantined, self.inner.on_quarantine = self.quarantined, self._quarantine
        if state is not None:
            self.inner.load_state_dict(state)
        log.info("--follow: reading %d new file(s): %s", len(files), ", ".join(files))

    def __iter__(self) -> Iterator[dict]:
        while True:
            if self.inner is None:
                files = self._complete_new_files()
                if not files:
                    if self._wait():
                        return
                    continue
                self._open(files)
                if self.inner is None:
                    continue
            inner = self.inner.stats
            rows, bad = inner.rows, inner.bad_rows
            try:
                for batch in self.inner:
                    self.stats.rows += inner.rows - rows
                    self.stats.bad_rows += inner.bad_rows - bad
                    self.stats.batches += 1
                    rows, bad = inner.rows, inner.bad_rows
                    yield batch
            except DataError as err:  # the set as a whole (no valid row in it): said, and the stream goes on
                if isinstance(err, StoreError) and not err.missing:
                    raise
                if any(path not in self.quarantined for path in self.current):  # else each was said already
                    log.warning("--follow: %s; these files are done", err)
            self.stats.bad_rows += inner.bad_rows - bad
            for path in self.current:
                if path not in self.quarantined:
                    self.done.append(path)
                self._check_taken(path)
            self.current, self.inner = [], None

    def _wait(self) -> bool:
        """One poll interval, cut short by a stop request: True when the run should end."""
        deadline = time.monotonic() + self.poll_seconds
        while time.monotonic() < deadline:
            if self.should_stop():
                return True
            time.sleep(min(0.1, self.poll_seconds))
        return self.should_stop()

    def state_dict(self) -> dict:
        return {"follow": self.patterns, "done": list(self.done), "current": list(self.current),
                "reader": self.inner.state_dict() if self.inner is not None else None,
                "quarantined": dict(self.quarantined), "taken": {p: v.to_list() for p, v in self.taken.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("follow") != self.patterns:
            raise ConfigError(f"the checkpoint's reader followed {state.get('follow')}, not --data {self.patterns}: "
                              "resume --follow with the same --data")
        self.done, self.current, self.inner = list(state["done"]), [], None
        self.quarantined = dict(state.get("quarantined", {}))
        self.taken = {p: Version.from_list(v) for p, v in state.get("taken", {}).items()}
        if state["current"]:
            self._open(list(state["current"]), state["reader"])


__all__ = ["FollowReader"]
