"""Atomic checkpoints: written to a temp file, fsynced, then renamed into place.

A crash mid-write leaves the previous checkpoint intact; a reader never sees a
partial file. Files are `checkpoint-<step>.pt`; the highest step is the latest.
"""
from __future__ import annotations

import os
import re
import tempfile

import torch

_NAME = re.compile(r"^(checkpoint|incremental)-(\d+)\.pt$")


def save_checkpoint(directory: str, step: int, state: dict, keep: int = 3, kind: str = "checkpoint") -> str:
    """kind "checkpoint": a full save (older incremental ones become obsolete and are
    removed); kind "incremental": the rows touched since the last full save."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{kind}-{step:09d}.pt")
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    if kind == "checkpoint":
        for old in list_checkpoints(directory)[:-keep]:
            os.unlink(old)
        for old in list_checkpoints(directory, "incremental"):
            if checkpoint_step(old) <= step:
                os.unlink(old)
    return path


def list_checkpoints(directory: str, kind: str = "checkpoint") -> list[str]:
    """Complete checkpoints of one kind, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = sorted((int(m.group(2)), name) for name in os.listdir(directory)
                   if (m := _NAME.match(name)) and m.group(1) == kind)
    return [os.path.join(directory, name) for _, name in found]


def checkpoint_step(path: str) -> int:
    return int(_NAME.match(os.path.basename(path)).group(2))


def latest_checkpoint(directory: str) -> str | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def load_checkpoint(path: str) -> dict:
    # weights_only: a checkpoint holds tensors and plain containers; nothing is unpickled beyond that
    return torch.load(path, map_location="cpu", weights_only=True)


def load_model_weights(model: torch.nn.Module, state: dict) -> None:
    """Load a checkpoint's model state for inference: optimizer slots stored with
    the embeddings are skipped when `model` has no optimizer attached."""
    result = model.load_state_dict(state, strict=False)
    unexpected = [k for k in result.unexpected_keys if ".slot_" not in k]
    if result.missing_keys or unexpected:
        raise RuntimeError(f"checkpoint does not fit the model: missing {result.missing_keys}, "
                           f"unexpected {unexpected}")
