"""Where data lives: local paths, fsspec URLs (s3://, gs://, hdfs://, file://, ...) and compressed files.

    expand(pattern)       a path, folder, glob or URL -> the files it names (URLs stay URLs)
    open_ranged(path)     seekable binary file; remote: ranged GETs of BLOCK_BYTES with read-ahead, all of
                          one version (deeprec.data.ranged: If-Match on S3; a change is "changed while being read")
    open_stream(path)     sequential bytes, decompressed when the name ends .gz / .zst / .bz2
    size(path), first_line(path), open_parquet(path)

Local paths (no "scheme://") take the builtin `open`, as before. A URL goes through fsspec; its
protocol's package is an optional extra (`pip install 'deeprec[s3]'`: s3fs), and its credentials
come from where that package looks (environment, profile, instance role); fsspec's own settings
(`FSSPEC_S3_ENDPOINT_URL=...`, `FSSPEC_S3='{"anon": true}'`) apply too. Errors name the file and
what went wrong, never a secret: credential values found in the environment or in a URL are masked.
"""
from __future__ import annotations

import io
import os
import queue
import threading
from typing import Iterator

from deeprec.data import ranged
from deeprec.errors import DataError

from deeprec.data.stores import (  # noqa: F401  - fs.X, as the callers name them
    BLOCK_BYTES, COMPRESSIONS, EXTRAS, READ_AHEAD, StoreError, compression, describe, expand, filesystem, is_hidden,
    is_url, protocol, redact, remote_error, size)


# -- reading -------------------------------------------------------------------
def open_ranged(path: str, *, stop: int | None = None, block: int = BLOCK_BYTES, first=None):
    """A seekable binary file of the raw bytes (no decompression), of the version `first` when given
    (a `deeprec.data.ranged.Version`: a change is a ChangedError)."""

    if not is_url(path):
        return ranged.open_local(path, first)
    return ranged.RangeFile(path, stop=stop, block=block, first=first)


def open_raw_stream(path: str, first=None):
    """Sequential raw bytes: local `open`, or a RangeFile reading ahead."""
    return open_ranged(path, first=first)


class _Decompressed(io.RawIOBase):
    """A sequential file of the decompressed bytes (gzip incl. concatenated members: ISA-L's igzip
    when `isal` is installed, else pyarrow's; zstd and bz2: pyarrow's), errors as DataErrors naming
    the file."""

    def __init__(self, path: str, codec: str, first=None):
        import pyarrow as pa

        self.path = path
        igzip = _igzip() if codec == "gzip" else None
        if igzip is not None:  # ISA-L: gzip decompressed ~2.5x faster than zlib (pip install 'deeprec[gzip]')
            self._raw = open_raw_stream(path, first)
            self._stream, self._all = igzip.IGzipFile(fileobj=self._raw, mode="rb"), -1
            return
        if is_url(path):
            self._raw = open_raw_stream(path, first)
        else:  # OSFile: no Python per read
            try:
                self._raw = pa.OSFile(path)
            except OSError as err:
                raise remote_error(err, path) from None
            ranged.check_local(path, first, os.stat(path))
        self._stream, self._all = pa.CompressedInputStream(self._raw, codec), None

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        try:
            whole = n is None or n < 0
            return self._stream.read(self._all if whole else n)
        except DataError:
            raise
        except Exception as err:
            raise DataError(f"cannot decompress ({redact(err)}): a truncated or corrupt "
                            f"{compression(self.path)} file", redact(self.path)) from None

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        self._stream.close()
        self._raw.close()
        super().close()


def _igzip():
    try:
        from isal import igzip
    except ImportError:
        return None
    return igzip


def open_stream(path: str, first=None):
    """Sequential bytes of the file's content: decompressed when its name says it is compressed."""
    codec = compression(path)
    if codec is None:
        return open_raw_stream(path, first)
    return io.BufferedReader(_Decompressed(path, codec, first), buffer_size=1 << 16)


def first_line(path: str, first=None) -> bytes:
    """The first line of the (decompressed) content, newline included."""
    if compression(path) is None:
        with open_ranged(path, block=64 << 10, first=first) as f:
            return f.readline()
    with open_stream(path, first) as f:
        return f.readline()


def iter_blocks(path: str, block: int = BLOCK_BYTES, ahead: int = READ_AHEAD, first=None) -> Iterator[bytes]:
    """The (decompressed) content in blocks of about `block` bytes, read `ahead` blocks ahead in a thread
    (decompression in pyarrow and remote reads release the GIL, so they overlap the parsing)."""
    def produce():
        codec = compression(path)
        with (_Decompressed(path, codec, first) if codec else open_raw_stream(path, first)) as f:  # no copy
            while True:
                data = f.read(block)
                if not data:
                    return
                yield data

    return _prefetched(produce(), ahead, path)


def iter_range_blocks(url: str, start: int, end: int, block: int = BLOCK_BYTES,
                      ahead: int = READ_AHEAD, first=None) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) consecutive blocks of a remote object from `start` until one holds a newline at
    or after byte end-1 (the end of the last line beginning before `end`), read ahead in a thread: ranged
    GETs, their copies and joins all happen off the parsing thread."""

    def produce():
        with ranged.RangeFile(url, block=block, ahead=ahead, stop=end, first=first) as f:
            f.seek(start)
            pos = start
            while True:
                data = f.read(block)
                if not data:
                    return
                yield pos, data
                if pos + len(data) >= end and data.find(b"\n", max(end - 1 - pos, 0)) != -1:
                    return
                pos += len(data)

    return _prefetched(produce(), ahead, url)


def _prefetched(items: Iterator, depth: int, path: str = "?") -> Iterator:
    """`items` produced `depth` ahead in a thread ("deeprec-read-ahead"). Whatever ends the thread reaches
    the consumer as one line naming `path`: deeprec's own errors as they are, any other as a StoreError
    (`cannot read (OSError: ...)`); a thread that died without a word is said too, never waited for."""
    if depth <= 0:
        yield from items
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(entry) -> bool:
        """Queued, unless the consumer stopped first (a blocking put would then wait forever)."""
        while not stop.is_set():
            try:
                q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run():
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((done, None))
        except BaseException as err:  # handed to the consumer
            put((done, err))
        finally:  # the source's files closed here, by the thread that iterated it
            close = getattr(items, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # closing after an error: the error is what is said
                    pass

    thread = threading.Thread(target=run, name="deeprec-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            try:
                item, err = q.get(timeout=1.0)
            except queue.Empty:
                if thread.is_alive() or not q.empty():
                    continue
                raise _read_error(RuntimeError("the read-ahead thread ended without handing on its data"),
                                  path) from None
            if item is done:
                if err is not None:
                    raise _read_error(err, path) from None
                return
            yield item
    finally:
        stop.set()


def _read_error(err: BaseException, path: str) -> BaseException:
    """What the read-ahead thread's error says to the consumer: deeprec's errors (and interrupts) as
    they are; any other error one StoreError line naming the file."""
    from deeprec.errors import DeepRecError

    if isinstance(err, DeepRecError) or not isinstance(err, Exception):
        return err
    return StoreError(describe(err), redact(path), missing=isinstance(err, FileNotFoundError))


def open_parquet(path: str, first=None):
    """A pyarrow ParquetFile; remote files through their fsspec filesystem (ranged reads), of the
    version `first` when given."""
    import pyarrow.parquet as pq

    source = ranged.open_pinned(path, first)
    if not is_url(path):
        return pq.ParquetFile(source)
    return pq.ParquetFile(source, pre_buffer=True)
