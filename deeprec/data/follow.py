"""`--follow`: continuous training over data that keeps landing (hourly partitions, a log shipper).

    files matching --data, in name order ──> reader over them (one pass) ──> batches
          ▲                                        │ ended
          └── poll every --follow-interval s <─────┘ until files not read yet are complete

A file is taken once its size and modification time held still over one poll, or it is older than
a poll interval (a writer still appending is waited for); names starting with "." or "_" are never taken (Hadoop's and Hive's
temporary and marker files: `_SUCCESS`, `.part-0.crc`). Each file is read once, in name order,
batch after batch across files (the last batch of a set may be short). The position (files done,
the reader's place in the ones being read) goes into checkpoints, so `--resume` goes on exactly.
The wait ends when the run is asked to stop (`should_stop`, SIGINT/SIGTERM in the trainer).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Iterator

from deeprec.data import fs
from deeprec.data.reader import ReaderStats, resolve_paths
from deeprec.errors import ConfigError, DeepRecError

log = logging.getLogger("deeprec.data")


def _stat(path: str) -> tuple[int, float | None]:
    """(size, modification time in seconds; None where the store gives none)."""
    if not fs.is_url(path):
        info = os.stat(path)
        return info.st_size, info.st_mtime
    filesystem, inner = fs.filesystem(path)
    info = filesystem.info(inner)
    modified = info.get("LastModified") or info.get("mtime")
    return int(info["size"]), modified.timestamp() if hasattr(modified, "timestamp") else None


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
        self.inner = None
        self.stats = ReaderStats()
        self._sizes: dict[str, tuple] = {}  # a candidate's (size, mtime) at the last poll
        self._waiting_on: str | None = None  # why the last look listed nothing (said once)

    def _complete_new_files(self) -> list[str]:
        """Files not yet read whose size and mtime have not changed since the last poll."""
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
        seen = set(self.done) | set(self.current)
        ready, sizes, now = [], {}, time.time()
        for path in matched:
            if path in seen or fs.is_hidden(os.path.basename(path)) or not self.owns(path):
                continue
            try:
                size, modified = _stat(path)
            except (OSError, DeepRecError):  # removed between the listing and now
                continue
            sizes[path] = (size, modified)
            old = modified is not None and now - modified >= self.poll_seconds
            if (self._sizes.get(path) == sizes[path] or old) and size > 0:
                ready.append(path)
        self._sizes = sizes
        return sorted(ready)

    def _open(self, files: list[str], state: dict | None = None) -> None:
        self.current, self.inner = files, self.open_files(files)
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
            inner = self.inner.stats
            rows, bad = inner.rows, inner.bad_rows
            for batch in self.inner:
                self.stats.rows += inner.rows - rows
                self.stats.bad_rows += inner.bad_rows - bad
                self.stats.batches += 1
                rows, bad = inner.rows, inner.bad_rows
                yield batch
            self.done.extend(self.current)
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
                "reader": self.inner.state_dict() if self.inner is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if state.get("follow") != self.patterns:
            raise ConfigError(f"the checkpoint's reader followed {state.get('follow')}, not --data {self.patterns}: "
                              "resume --follow with the same --data")
        self.done, self.current, self.inner = list(state["done"]), [], None
        if state["current"]:
            self._open(list(state["current"]), state["reader"])


__all__ = ["FollowReader"]
