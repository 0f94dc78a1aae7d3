"""Where data lives, named: local paths and fsspec URLs (s3://, gs://, hdfs://, file://, ...), their
filesystems, listings and sizes, and the errors a store gives, in words without secrets. deeprec.data.fs
opens them; deeprec.data.ranged reads a remote file as one version.
"""
from __future__ import annotations

import os
import re

from deeprec.errors import ConfigError, DataError, without_password


class StoreError(DataError):
    """The store could not be read (network, credentials, a file that is gone); `missing`: it is gone."""

    def __init__(self, message: str, path: str | None = None, missing: bool = False):
        super().__init__(message, path)
        self.missing = missing


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


def cache_root() -> str:
    """The folder of what deeprec keeps between runs (synthetic data, compiled serving packages):
    $DEEPREC_CACHE, default ~/.cache/deeprec."""
    return os.environ.get("DEEPREC_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "deeprec"))


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
