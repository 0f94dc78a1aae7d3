"""Exceptions raised by deeprec. Each names what went wrong and where."""
import re

_URL_PASSWORD = re.compile(r"(://[^/:@\s]*):[^/@\s]*@")


def without_password(text: str) -> str:
    """`text` with the password of any URL in it (scheme://user:password@host) masked."""
    return _URL_PASSWORD.sub(r"\1:***@", str(text))


class DeepRecError(Exception):
    """Base class of every error deeprec raises on purpose."""


class DataError(DeepRecError, ValueError):
    """A row or file that cannot be read as the declared schema.

    ``path`` and ``line`` (1-based physical line, or row index for Parquet)
    locate the offending record when known.
    """

    def __init__(self, message: str, path: str | None = None, line: int | None = None):
        where = ""
        if path is not None:
            path = without_password(path)
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)
        self.path = path
        self.line = line
        self.reason = message


class OutOfRangeError(DeepRecError):
    """The input is exhausted (the seed's ``tf.errors.OutOfRangeError``)."""


class NonFiniteError(DeepRecError):
    """A loss or gradient that is inf or nan (training stops before applying it)."""


class CheckpointError(DeepRecError):
    """A checkpoint that is incomplete, truncated or corrupt; ``path`` names the file."""

    def __init__(self, message: str, path: str):
        super().__init__(f"checkpoint {path}: {message}")
        self.path, self.reason = path, message


class ExportError(DeepRecError):
    """A serving export written while training (--export-dir) that could not be written (a full disk, a
    folder that cannot be written); ``path`` is the export folder, ``step`` the step exported."""

    def __init__(self, path: str, step: int, err: OSError, flag: str = "--export-dir"):
        super().__init__(f"{flag} {path}: the export of step {step} cannot be written ({err.strerror or err})")
        self.path, self.step, self.reason = path, step, err.strerror or str(err)


class ConfigError(DeepRecError, ValueError):
    """An option with a value outside its allowed set or range."""


class EmptyShardError(ConfigError):
    """A reader's shard(s) own no rows of files that do hold rows: more shards than the data can
    be cut into. ``paths``, ``shard_index``, ``num_shards`` say which; ``max_shards`` is how many
    shards the data gives (exact for Parquet: its row groups; an estimate for text files)."""

    def __init__(self, message: str, *, paths, shard_index, num_shards: int, max_shards: int):
        super().__init__(message)
        self.paths, self.shard_index, self.num_shards, self.max_shards = list(paths), shard_index, num_shards, max_shards
        self.reason = message


def regular_file(path: str, what: str) -> str:
    """`path` if it is a regular file; a ConfigError naming `what` (the option) otherwise. Checked
    before reading: a device or a pipe (/dev/zero) would be read until memory runs out."""
    import os

    if not os.path.exists(path):
        raise ConfigError(f"{what}: no such file: {path!r}")
    if not os.path.isfile(path):
        kind = "a folder" if os.path.isdir(path) else "not a regular file"
        raise ConfigError(f"{what}: {path!r} is {kind}; give a file")
    return path


def check_choice(option: str, value, allowed) -> None:
    """Raise ConfigError naming the option and its allowed values."""
    if value not in allowed:
        raise ConfigError(
            f"{option}={value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}"
        )


class StorageFullError(DeepRecError):
    """The disk tier's filesystem has no room for the rows it must hold (or a file size limit stops
    its file growing). ``path`` is the folder (--storage-path), ``needed`` the bytes it asked for."""

    def __init__(self, path: str, needed: int, reason: str = "no space left"):
        super().__init__(f"{reason} on {path}: {needed} bytes needed for the disk tier's rows (give "
                         "--storage-path a folder on a larger filesystem, or raise --dram-bytes to keep more rows "
                         "in DRAM)")
        self.path, self.needed, self.reason = path, needed, reason
