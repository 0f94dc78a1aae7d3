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
import re
import threading
from typing import Iterator

from deeprec.errors import ConfigError, DataError, without_password

BLOCK_BYTES = 4 << 20  # one ranged GET
READ_AHEAD = 2  # blocks fetched ahead of the one being read
COMPRESSIONS = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2"}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# which extra installs a protocol's fsspec implementation
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "abfs": "azure", "az": "azure", "abfss": "azure",
          "oss": "oss"}
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "GOOGLE_APPLICATION_CREDENTIALS",
               "AZURE_STORAGE_KEY", "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_SAS_TOKEN",
               "OSS_ACCESS_KEY_SECRET", "OSS_ACCESS_KEY_ID")


def is_hidden(name: str) -> bool:
    """A file or folder name that holds no data: Hadoop's, Hive's and Spark's temporary and marker
    files (`_SUCCESS`, `_temporary`, `.part-0.crc`) start with `_` or `.`."""
    return name.startswith((".", "_"))


def is_url(path: str) -> bool:
    return bool(_URL.match(str(path)))


def protocol(path: str) -> str | None:
    m = _URL.match(str(path))
    return m.group(1).lower() if m else None


def compression(path: str) -> str | None:
    """The codec a file name says ("gzip", "zstd", "bz2"), or None."""
    name = str(path).lower()
    return next((codec for suffix, codec in COMPRESSIONS.items() if name.endswith(suffix)), None)


def redact(text: str) -> str:
    """`text` with credential values (from the environment or a URL's user:password@) masked."""
    text = without_password(text)
    for name in _SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


def filesystem(url: str, option: str | None = None):
    """(fsspec filesystem, path within it) of a URL; a missing protocol package names its extra
    (errors start with `option`, the flag that gave the URL, when given)."""
    named = f"{option}: " if option else ""
    try:
        import fsspec
    except ImportError as err:  # pragma: no cover - fsspec comes with torch
        raise ConfigError(f"{named}{redact(url)}: reading URLs needs fsspec (pip install fsspec)") from err
    proto = protocol(url)
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as err:
        extra = EXTRAS.get(proto)
        hint = f"pip install 'deeprec[{extra}]'" if extra else f"install fsspec's implementation of {proto}://"
        raise ConfigError(f"{named}{redact(url)}: {proto}:// needs a package that is not installed ({hint}): "
                          f"{redact(err)}") from None
    except ValueError as err:
        raise ConfigError(f"{named}{redact(url)}: {redact(err)}") from None


def describe(err: BaseException) -> str:
    """What went wrong, in words, without credentials."""
    name = type(err).__name__
    if isinstance(err, FileNotFoundError):
        return "no such file or object"
    if isinstance(err, PermissionError) or name in ("NoCredentialsError", "PartialCredentialsError",
                                                    "ClientError") and "403" in str(err):
        return ("access denied: check the credentials (the environment, e.g. AWS_ACCESS_KEY_ID / AWS_PROFILE, "
                f"or the profile files) and the permissions of this object ({redact(err)})")
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return ("no credentials found: set them in the environment (e.g. AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) or a profile file")
    return f"cannot read ({name}: {redact(err)})"


def remote_error(err: BaseException, path: str, option: str | None = None, cls=None):
    """A StoreError (a DataError) naming the file and what went wrong; `cls`: another class, given one line."""
    from deeprec.data.ranged import StoreError

    named = f"{option}: " if option else ""
    if cls is None:
        return StoreError(named + describe(err), redact(path), missing=isinstance(err, FileNotFoundError))
    return cls(f"{named}{redact(path)}: {describe(err)}")


# -- listing -------------------------------------------------------------------
def expand(pattern: str, option: str | None = None) -> list[str]:
    """The files a URL names: itself, a folder's files (names starting with '.' or '_', such as
    _SUCCESS, are skipped), or a glob's matches; sorted URLs. Errors are ConfigErrors named by `option`."""
    named = f"{option}: " if option else ""
    fs, path = filesystem(pattern, option)
    proto = protocol(pattern)

    def url(p: str) -> str:
        return p if is_url(p) else f"{proto}://{p.lstrip('/') if proto != 'file' else p}"

    try:
        if any(ch in path for ch in "*?["):
            matched = fs.glob(path, detail=True)
            files = sorted(url(p) for p, info in matched.items() if info.get("type") != "directory")
            if not files:
                raise ConfigError(named + f"no file matches {redact(pattern)!r}")
            return files
        info = fs.info(path)
        if info.get("type") == "directory":
            files = sorted(url(i["name"]) for i in fs.ls(path, detail=True) if i.get("type") != "directory"
                           and not is_hidden(os.path.basename(i["name"].rstrip("/"))))
            if not files:
                raise ConfigError(named + f"folder {redact(pattern)!r} holds no data files (names starting with "
                                  "'.' or '_' are ignored)")
            return files
        return [pattern]
    except ConfigError:
        raise
    except FileNotFoundError:
        raise ConfigError(named + f"no such file or object: {redact(pattern)!r}") from None
    except Exception as err:  # credentials, network, a bucket that does not exist
        raise ConfigError(f"{named}{redact(pattern)}: {describe(err)}") from None


def size(path: str) -> int:
    if not is_url(path):
        return os.path.getsize(path)
    fs, p = filesystem(path)
    try:
        return int(fs.size(p))
    except Exception as err:
        raise remote_error(err, path) from None


# -- reading -------------------------------------------------------------------
def open_ranged(path: str, *, stop: int | None = None, block: int = BLOCK_BYTES, first=None):
    """A seekable binary file of the raw bytes (no decompression), of the version `first` when given
    (a `deeprec.data.ranged.Version`: a change is a ChangedError)."""
    from deeprec.data.ranged import RangeFile, open_local

    if not is_url(path):
        return open_local(path, first)
    return RangeFile(path, stop=stop, block=block, first=first)


def open_raw_stream(path: str, first=None):
    """Sequential raw bytes: local `open`, or a RangeFile reading ahead."""
    return open_ranged(path, first=first)


class _Decompressed(io.RawIOBase):
    """A sequential file of the decompressed bytes (gzip incl. concatenated members: ISA-L's igzip
    when `isal` is installed, else pyarrow's; zstd and bz2: pyarrow's), errors as DataErrors naming
    the file."""

    def __init__(self, path: str, codec: str, first=None):
        import pyarrow as pa

        from deeprec.data.ranged import check_local

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
            check_local(path, first, os.stat(path))
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
    from deeprec.data.ranged import RangeFile

    def produce():
        with RangeFile(url, block=block, ahead=ahead, stop=end, first=first) as f:
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
    from deeprec.data.ranged import StoreError
    from deeprec.errors import DeepRecError

    if isinstance(err, DeepRecError) or not isinstance(err, Exception):
        return err
    return StoreError(describe(err), redact(path), missing=isinstance(err, FileNotFoundError))


def open_parquet(path: str, first=None):
    """A pyarrow ParquetFile; remote files through their fsspec filesystem (ranged reads), of the
    version `first` when given."""
    import pyarrow.parquet as pq

    from deeprec.data.ranged import open_pinned

    source = open_pinned(path, first)
    if not is_url(path):
        return pq.ParquetFile(source)
    return pq.ParquetFile(source, pre_buffer=True)
