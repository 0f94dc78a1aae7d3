"""Durable, atomic file writes and sha256 manifests: checkpoints, serving exports and deltas.

    write_atomic(path, content)    content (bytes, or write(tmp) filling a temporary file of path's
                                   folder), fsynced, renamed over path, then the folder fsynced
    write_with_manifest(...)       the payload, then a JSON manifest with its "bytes" and "sha256":
                                   the payload counts only once its manifest is there
    replace_dir(staging, path)     a whole folder (an export): every file fsynced, then swapped in

A crash (or an exception in `write`) at any point leaves `path` as it was (the previous
version, or absent); at most a temporary file (`prefix`...`.tmp`) stays behind, which
the writer's owner may sweep (deeprec.checkpoint.remove_stale_temporaries).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Callable

TEMP_SUFFIX = ".tmp"


def sha256_file(path: str) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks (bounded memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path: str) -> None:
    """fsync a file or a folder by name (a folder: makes the renames in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


Content = Callable[[str], object] | bytes | bytearray | memoryview


def _writer(content: Content) -> Callable[[str], object]:
    if callable(content):
        return content

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(content)
    return write


def write_atomic(path: str, content: Content, *, prefix: str | None = None) -> None:
    """Write `content` (bytes, or `write(tmp)` called with a temporary path in `path`'s folder, so
    the rename stays on one file system), fsync it, rename it to `path`, fsync the folder. If
    the write raises, the temporary file is removed and `path` is untouched."""
    write = _writer(content)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=prefix or f".{os.path.basename(path)}-", suffix=TEMP_SUFFIX, dir=directory)
    os.close(fd)  # writers such as safetensors' save_file take a path, not a file object
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_path(directory)


def write_json(path: str, value, *, prefix: str | None = None, indent: int | None = None) -> None:
    """`write_atomic` of a JSON document."""
    write_atomic(path, json.dumps(value, indent=indent).encode(), prefix=prefix)


def write_with_manifest(path: str, manifest_file: str, content: Content, manifest: dict, *,
                        prefix: str | None = None) -> dict:
    """Write the payload (`write_atomic(path, content)`), then `manifest` plus the payload's
    "bytes" and "sha256" to `manifest_file`. Returns the manifest written."""
    written, write = {}, _writer(content)

    def hashed(tmp: str) -> None:  # hash the temporary file: what gets renamed is what was hashed
        write(tmp)
        written.update(bytes=os.path.getsize(tmp), sha256=sha256_file(tmp))

    write_atomic(path, hashed, prefix=prefix)
    manifest = {**manifest, **written}
    write_json(manifest_file, manifest, prefix=prefix)
    return manifest


def replace_dir(staging: str, path: str) -> None:
    """Make the folder `staging` (a sibling of `path`) durable and rename it to `path`; an
    older `path` is renamed aside first and removed only once the new one is in place."""
    for name in os.listdir(staging):
        fsync_path(os.path.join(staging, name))
    fsync_path(staging)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        old = path.rstrip("/") + f".old-{os.getpid()}"
        os.replace(path, old)
        os.replace(staging, path)
        fsync_path(parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, path)
        fsync_path(parent)


__all__ = ["sha256_file", "fsync_path", "write_atomic", "write_json", "write_with_manifest",
           "replace_dir"]
