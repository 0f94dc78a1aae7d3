"""A file or object read as one version: ranged reads pinned to the version first seen.

    version(path)            the Version of a file or object now: size, tag (ETag, generation, inode), mtime
    RangeFile(url, version)  a seekable view of a remote object made of ranged GETs of that version
    open_pinned(path, ver)   a local path or an fsspec file of that version (Parquet, ORC)
    ChangedError             "changed while being read": a DataError naming the file or URL
    StoreError               the store could not be read at all (network, credentials, gone)

S3 (and S3-compatible stores, through s3fs) pins every ranged GET with `If-Match: <ETag>`: the store
refuses any other version (412), which is a ChangedError. Other fsspec stores have no such header
here: the object's version is looked up again after each block read, so a change between two reads
is caught. Local files are pinned by inode: a file renamed over the name, or truncated, between
the reader's first look and a read is a ChangedError; one appended to is read up to the size first
seen (what `--follow` reports, deeprec/data/follow.py).
"""
from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from deeprec.data import stores
from deeprec.data.stores import StoreError  # noqa: F401  - ranged.StoreError, as its callers name it
from deeprec.errors import DataError

_TAGS = ("ETag", "etag", "generation", "VersionId", "md5Hash", "ino")  # what names one version, by store
_TIMES = ("LastModified", "mtime", "last_modified", "updated", "modified", "created")


class ChangedError(DataError):
    """A file or object that changed between the reader's first look and a later read of it."""


@dataclass(frozen=True)
class Version:
    """One version of a file: its size, a tag naming the version where the store has one (S3's ETag,
    GCS's generation, a local inode), and its modification time (seconds; None where not given)."""

    size: int
    tag: str | None = None
    modified: float | None = None

    def same(self, other: "Version") -> bool:
        """The same bytes: size and tag equal (an ETag or a generation names the content); where the tag
        is a local inode, which outlives rewrites, or there is none, the mtime too."""
        if self.tag is not None and not self.tag.startswith("ino:"):
            return (self.size, self.tag) == (other.size, other.tag)
        return (self.size, self.tag, self.modified) == (other.size, other.tag, other.modified)

    def change(self, now: "Version") -> str:
        """How `now` differs from this version, in words."""
        if self.tag == now.tag and now.size > self.size:
            return f"grew from {self.size} to {now.size} bytes"
        if self.tag == now.tag:
            return f"was rewritten in place ({self.size} -> {now.size} bytes)"
        return f"was replaced by another file or object ({self.size} -> {now.size} bytes)"

    def words(self) -> str:
        tag = f", {self.tag}" if self.tag else ""
        return f"{self.size} bytes{tag}"

    def to_list(self) -> list:
        return [self.size, self.tag, self.modified]

    @classmethod
    def from_list(cls, value) -> "Version":
        return cls(int(value[0]), value[1], value[2])


def from_info(info: dict) -> Version:
    """The Version an fsspec `info()` entry describes."""
    tag = next((f"{k.lower()}:{info[k]}" if k == "ino" else str(info[k]) for k in _TAGS if info.get(k)), None)
    modified = next((info[k] for k in _TIMES if info.get(k) is not None), None)
    if hasattr(modified, "timestamp"):
        modified = modified.timestamp()
    elif isinstance(modified, str):
        modified = None if tag else _parse_time(modified)
    return Version(int(info.get("size") or 0), tag, float(modified) if modified is not None else None)


def _parse_time(text: str) -> float | None:
    from datetime import datetime

    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _local(stat: os.stat_result) -> Version:
    return Version(stat.st_size, f"ino:{stat.st_dev}:{stat.st_ino}", stat.st_mtime)


def version(path: str, fresh: bool = False) -> Version:
    """The file's version now (fresh: not from a cached listing)."""
    if not stores.is_url(path):
        try:
            return _local(os.stat(path))
        except OSError as err:
            raise stores.remote_error(err, path) from None
    filesystem, inner = stores.filesystem(path)
    try:
        if fresh:
            filesystem.invalidate_cache(inner)
        return from_info(filesystem.info(inner))
    except Exception as err:
        raise stores.remote_error(err, path) from None


def versions(paths: list[str]) -> dict:
    """{path: its version now}: what a reader pins when it is made. Looked up afresh, never from a listing
    cached earlier in the process (an object overwritten since would read as changed); remote ones 8 at a time."""
    remote = [p for p in paths if stores.is_url(p)]
    found = dict(zip(remote, _pool().map(lambda p: version(p, fresh=True), remote))) if remote else {}
    return {p: found[p] if p in found else version(p) for p in paths}


def changed(path: str, first: Version, now: Version | None = None) -> ChangedError:
    how = f"it {first.change(now)}" if now is not None else "another version replaced it"
    return ChangedError(f"changed while being read: {how} after reading began (the version first seen: "
                        f"{first.words()}); nothing of the new version is read: land new data under a new name",
                        stores.redact(path))


def is_expired(err: BaseException) -> bool:
    """An fsspec error saying the object is no longer the version its file was opened at."""
    return any(type(e).__name__ == "FileExpired" for e in (err, err.__cause__, err.__context__) if e is not None)


def check_local(path: str, first: Version | None, stat: os.stat_result) -> None:
    """A ChangedError when the local file opened (`stat`: its fstat) is not `first`: another inode, or shorter."""
    if first is None:
        return
    now = _local(stat)
    if now.tag != first.tag or now.size < first.size:
        raise changed(path, first, now)


def open_local(path: str, first: Version | None = None):
    """A local file opened for reading, checked against the version first seen."""
    try:
        f = open(path, "rb")
    except OSError as err:
        raise stores.remote_error(err, path) from None
    try:
        check_local(path, first, os.fstat(f.fileno()))
    except BaseException:
        f.close()
        raise
    return f


def open_pinned(path: str, first: Version | None = None):
    """For pyarrow's Parquet and ORC readers: a local path (its inode checked against `first`), or an
    fsspec file of a URL whose version is `first` (its reads pinned by If-Match where the store has it)."""
    if not stores.is_url(path):
        if first is not None:
            check_local(path, first, os.stat(path))
        return path
    filesystem, inner = stores.filesystem(path)
    try:
        if first is None:  # the version there now, not one a listing cached earlier
            filesystem.invalidate_cache(inner)
        f = filesystem.open(inner, "rb", block_size=stores.BLOCK_BYTES, cache_type="readahead")
    except Exception as err:
        raise stores.remote_error(err, path) from None
    details = getattr(f, "details", None)
    if first is not None and isinstance(details, dict) and not from_info(details).same(first):
        f.close()
        raise changed(path, first, from_info(details))
    return f


# -- ranged reads ------------------------------------------------------------------
_pools: dict[int, ThreadPoolExecutor] = {}


def _pool() -> ThreadPoolExecutor:
    """One fetch pool per process (a forked DataLoader worker makes its own)."""
    pid = os.getpid()
    if pid not in _pools:
        _pools[pid] = ThreadPoolExecutor(max_workers=8, thread_name_prefix="deeprec-fetch")
    return _pools[pid]


class RangeFile(io.RawIOBase):
    """A read-only seekable view of a remote object made of ranged reads of `block` bytes, all of
    one version (`first`, or the one there when it is opened); reading block i fetches blocks
    i+1..i+ahead in the background (up to `stop`), so the next GETs overlap the parsing of this one.
    Only the current and previous blocks are kept."""

    def __init__(self, url: str, *, block: int = stores.BLOCK_BYTES, ahead: int = stores.READ_AHEAD, stop: int | None = None,
                 first: Version | None = None):
        self.url = url
        self._fs, self._path = stores.filesystem(url)
        self._file = None  # the store's own file object, when its ranged reads can be pinned (s3fs: If-Match)
        try:
            if first is None:  # the version there now, not one a listing cached earlier
                self._fs.invalidate_cache(self._path)
            opened = self._fs.open(self._path, "rb", block_size=block, cache_type="none")
        except Exception as err:
            raise stores.remote_error(err, url) from None
        if type(opened).__module__.startswith("s3fs") and hasattr(opened, "_fetch_range") and \
                "ETag" in (opened.details or {}):  # its GETs carry If-Match: <that ETag>
            self._file, now = opened, from_info(opened.details)
        else:
            opened.close()
            now = version(url, fresh=True)
        if first is not None and not first.same(now):
            self.close()
            raise changed(url, first, now)
        self.version = first or now
        self._size = self.version.size
        self._block, self._ahead = block, ahead
        self._stop = self._size if stop is None else min(self._size, stop + block)
        self._blocks: dict = {}
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else self._pos + pos if whence == 1 else self._size + pos
        return self._pos

    def _fetch(self, i: int) -> bytes:
        start = i * self._block
        end = min(self._size, start + self._block)
        try:
            if self._file is not None:  # pinned: the store answers 412 for any other version
                return self._file._fetch_range(start, end)
            data = self._fs.cat_file(self._path, start=start, end=end)
        except Exception as err:
            if is_expired(err) or isinstance(err, FileNotFoundError):
                raise changed(self.url, self.version) from None
            raise stores.remote_error(err, self.url) from None
        now = version(self.url, fresh=True)  # no pinned read here: the version is looked up again
        if not now.same(self.version):
            raise changed(self.url, self.version, now)
        return data

    def _get(self, i: int) -> bytes:
        for j in range(i, i + self._ahead + 1):
            if j not in self._blocks and (j == i or j * self._block < self._stop):
                self._blocks[j] = _pool().submit(self._fetch, j)
        for j in [j for j in self._blocks if j < i - 1]:
            self._blocks.pop(j).cancel()
        try:
            data = self._blocks[i].result()
        except DataError:
            self._blocks.pop(i, None)
            raise
        except Exception as err:
            self._blocks.pop(i, None)
            raise stores.remote_error(err, self.url) from None
        if len(data) != min(self._block, self._size - i * self._block):  # a shorter object answered
            raise changed(self.url, self.version)
        return data

    def read(self, n: int = -1) -> bytes:
        n = self._size - self._pos if n is None or n < 0 else min(n, self._size - self._pos)
        parts = []
        while n > 0:
            i, off = divmod(self._pos, self._block)
            piece = memoryview(self._get(i))[off:off + n]
            if not piece:
                break
            parts.append(piece)
            self._pos += len(piece)
            n -= len(piece)
        return b"".join(parts)

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def readline(self, limit: int = -1) -> bytes:
        parts = []
        while self._pos < self._size:
            i, off = divmod(self._pos, self._block)
            block = self._get(i)
            newline = block.find(b"\n", off)
            piece = block[off:] if newline == -1 else block[off:newline + 1]
            parts.append(piece)
            self._pos += len(piece)
            if newline != -1:
                break
        return b"".join(parts)

    def close(self) -> None:
        for future in getattr(self, "_blocks", {}).values():
            future.cancel()
        getattr(self, "_blocks", {}).clear()
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = None
        super().close()
