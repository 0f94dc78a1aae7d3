"""Tables as Hive, Spark and ODPS store them: partition folders and the file format.

    warehouse/clicks/dt=2026-11-24/hour=05/part-00000.parquet

A table root (or any partition folder) lists its files recursively, partitions in
name order (`hour=5` before `hour=10`: digit runs compare as numbers, so hourly and
daily partitions train in time order), leaving out Hadoop's bookkeeping files
(`_SUCCESS`, `_committed_*`, `.crc`: names starting with `_` or `.`). Each file's
partition values are the `key=value` folders of its path; a schema column missing
from a file is taken from them (`hour` as a categorical, say).
"""
from __future__ import annotations

import functools
import os
import re
from urllib.parse import unquote

from deeprec.data.fs import is_hidden

PARQUET_SUFFIXES = (".parquet", ".pq")
ORC_SUFFIXES = (".orc",)
HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"  # Hive's folder name for a null partition value
_PARTITION = re.compile(r"^([^=]+)=(.*)$")


def is_partition_folder(name: str) -> bool:
    return bool(_PARTITION.match(name)) and not is_hidden(name)


def natural_key(name: str):
    """Digit runs compare as numbers: hour=5 < hour=10, part-2 < part-10; otherwise name order."""
    return [(0, int(part), part) if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def list_table(root: str) -> list[str] | None:
    """The data files of a Hive-partitioned folder in partition order, or None when `root`
    has no `key=value` subfolder (a plain folder: listed by the caller as before)."""
    entries = [e for e in os.listdir(root) if not is_hidden(e)]
    if not any(is_partition_folder(e) and os.path.isdir(os.path.join(root, e)) for e in entries):
        return None
    out = []

    def walk(folder):
        names = [e for e in os.listdir(folder) if not is_hidden(e)]
        for name in sorted(names, key=natural_key):
            path = os.path.join(folder, name)
            if os.path.isdir(path):
                walk(path)
            elif not name.endswith(".crc"):
                out.append(path)

    walk(root)
    return out


def list_remote_table(url: str) -> list[str] | None:
    """`list_table` for a URL (s3://bucket/warehouse/clicks/): its files in partition order as
    URLs, or None when it is no folder with `key=value` subfolders (or cannot be listed here:
    `deeprec.data.fs.expand` then lists it, or names what went wrong)."""
    from deeprec.data import fs

    try:
        filesystem, root = fs.filesystem(url)
        entries = filesystem.ls(root, detail=True)
    except Exception:
        return None
    proto = fs.protocol(url)

    def name(entry):
        return os.path.basename(entry["name"].rstrip("/"))

    def as_url(p):
        return p if fs.is_url(p) else f"{proto}://{p.lstrip('/') if proto != 'file' else p}"

    if not any(entry.get("type") == "directory" and is_partition_folder(name(entry)) for entry in entries):
        return None
    out = []

    def walk(entries):
        for entry in sorted(entries, key=lambda e: natural_key(name(e))):
            if is_hidden(name(entry)) or name(entry).endswith(".crc"):
                continue
            if entry.get("type") == "directory":
                walk(filesystem.ls(entry["name"], detail=True))
            else:
                out.append(as_url(entry["name"]))

    walk(entries)
    return out


def partition_values(path: str) -> dict[str, str | None]:
    """The `key=value` folders of a file's path (URI-decoded as Hive escapes them; Hive's
    default partition is None, a missing value); the innermost wins when a key repeats."""
    values = {}
    for part in os.path.normpath(os.path.dirname(path)).split(os.sep):
        m = _PARTITION.match(part)
        if m and not is_hidden(part):
            value = unquote(m.group(2))
            values[unquote(m.group(1))] = None if value == HIVE_NULL else value
    return values


@functools.lru_cache(maxsize=65536)  # one ranged read per remote file, not one per listing or --follow look
def file_format(path: str) -> str:
    """"parquet", "orc" or "text": by extension, else by the file's magic bytes (Hive and
    ODPS write ORC and Parquet files with no extension: 000000_0, part-00000)."""
    if path.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if path.endswith(ORC_SUFFIXES):
        return "orc"
    if os.path.splitext(os.path.basename(path))[1] in (".csv", ".tsv", ".txt"):
        return "text"
    try:
        head = _head(path)
    except Exception:  # unreadable here: the reader names the problem when it opens the file
        return "text"
    if head == b"PAR1":
        return "parquet"
    if head[:3] == b"ORC":
        return "orc"
    return "text"


def _head(path: str) -> bytes:
    """The first 4 bytes of a local file or a URL (one ranged read)."""
    from deeprec.data import fs

    if not fs.is_url(path):
        with open(path, "rb") as f:
            return f.read(4)
    filesystem, inner = fs.filesystem(path)
    return filesystem.cat_file(inner, start=0, end=4)
