"""Atomic, verified checkpoints.

    checkpoint-<step>.pt              the payload (torch.save of tensors and plain containers)
    checkpoint-<step>.manifest.json   {"format", "kind", "step", "bytes", "sha256"} of the payload

Both are written by deeprec.atomic (temporary file, fsync, rename, fsync of the folder), the payload
first: a checkpoint counts only once its manifest is there, so a crash mid-write
leaves the previous checkpoints intact and at most a payload without a manifest
(reported and skipped by resume). Loading checks size and sha256 before unpickling
(weights_only), and every failure names the file. Stale temporary files of a killed
writer are removed by `remove_stale_temporaries` at the start of a run.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re

import torch

from deeprec.atomic import write_with_manifest
from deeprec.errors import CheckpointError

FORMAT = 1
_NAME = re.compile(r"^(checkpoint|incremental)-(\d+)\.pt$")
TEMP_PREFIX = ".checkpoint-"  # remove_stale_temporaries sweeps these
_TEMP = re.compile(r"^\.checkpoint-.*\.tmp$")
log = logging.getLogger("deeprec.checkpoint")


def manifest_path(path: str) -> str:
    return path[: -len(".pt")] + ".manifest.json"


def save_checkpoint(directory: str, step: int, state: dict, keep: int = 3, kind: str = "checkpoint") -> str:
    """kind "checkpoint": a full save (older incremental ones become obsolete and are
    removed); kind "incremental": the rows touched since the last full save."""
    path = os.path.join(directory, f"{kind}-{step:09d}.pt")
    buffer = io.BytesIO()
    torch.save(state, buffer)  # serialized first: a state that fails to pickle leaves no file
    payload = buffer.getbuffer()
    try:  # a full disk: no file of this checkpoint is left, the older ones stay intact
        os.makedirs(directory, exist_ok=True)
        write_with_manifest(path, manifest_path(path), payload, {"format": FORMAT, "kind": kind, "step": step},
                            prefix=TEMP_PREFIX)
    except OSError as err:
        _remove_unverified(path)  # a payload whose manifest could not follow it
        raise CheckpointError(f"cannot be written ({err.strerror or err})", path) from None
    if kind == "checkpoint":
        for old in list_checkpoints(directory)[:-keep]:
            _remove(old)
        for old in list_checkpoints(directory, "incremental"):
            if checkpoint_step(old) <= step:
                _remove(old)
    return path


def _remove(path: str) -> None:
    for p in (manifest_path(path), path):  # the manifest first: a half-removed checkpoint reads as incomplete
        if os.path.exists(p):
            os.unlink(p)


def _remove_unverified(path: str) -> None:
    try:
        verified_payload(path)
    except CheckpointError:
        _remove(path)


def remove_stale_temporaries(directory: str) -> list[str]:
    """Delete the temporary files a killed writer left (call before this run writes any)."""
    if not os.path.isdir(directory):
        return []
    stale = [os.path.join(directory, n) for n in os.listdir(directory) if _TEMP.match(n)]
    for path in stale:
        os.unlink(path)
        log.warning("removed %s, left by an interrupted checkpoint write", path)
    return stale


def list_checkpoints(directory: str, kind: str = "checkpoint") -> list[str]:
    """Checkpoint payloads of one kind, oldest first (verified only when loaded)."""
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


def verified_payload(path: str) -> bytes:
    """The checkpoint's payload after checking it against its manifest; CheckpointError naming
    the file when it is incomplete, truncated or corrupt."""
    try:
        with open(manifest_path(path), "rb") as f:
            manifest = json.loads(f.read())
        expected, digest = int(manifest["bytes"]), str(manifest["sha256"])
    except FileNotFoundError:
        raise CheckpointError("no manifest (the write was interrupted, or it predates manifests)", path) from None
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"unreadable manifest ({err})", manifest_path(path)) from None
    try:
        with open(path, "rb") as f:
            payload = f.read()
    except OSError as err:
        raise CheckpointError(f"cannot read the payload ({err.strerror})", path) from None
    if len(payload) != expected:
        raise CheckpointError(f"truncated: {len(payload)} bytes, the manifest says {expected}", path)
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError("corrupt: the payload's sha256 differs from its manifest", path)
    return payload


def load_checkpoint(path: str) -> dict:
    """The checkpoint's state, verified first (`verified_payload`)."""
    payload = verified_payload(path)
    try:
        # weights_only: a checkpoint holds tensors and plain containers; nothing is unpickled beyond that
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as err:  # a payload that verifies but does not load: name the file
        raise CheckpointError(f"does not load ({type(err).__name__}: {err})", path) from None


def load_model_weights(model: torch.nn.Module, state: dict) -> None:
    """Load a checkpoint's model state for inference: optimizer slots stored with
    the embeddings are skipped when `model` has no optimizer attached. A module registered under
    several names (an EmbeddingVariable shared by two features) loads from whichever the state holds."""
    from deeprec.nn.shared import state_under_every_name

    try:
        state = state_under_every_name(model, state)
    except ValueError as err:
        raise RuntimeError(f"checkpoint does not fit the model: {err}") from None
    result = model.load_state_dict(state, strict=False)
    unexpected = [k for k in result.unexpected_keys if ".slot_" not in k]
    if result.missing_keys or unexpected:
        raise RuntimeError(f"checkpoint does not fit the model: missing {result.missing_keys}, "
                           f"unexpected {unexpected}")
