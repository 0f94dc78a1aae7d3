"""Checkpoints of collective training: one folder per rank, restored onto any world size.

    <checkpoint_dir>/rank-0-of-2/checkpoint-000000100.pt   rank 0's shard of every table (EmbeddingVariable or fixed),
    <checkpoint_dir>/rank-1-of-2/checkpoint-000000100.pt   the dense weights and optimizer (equal on all)

A restore looks at every `rank-R-of-K` folder and takes the newest step that all K ranks of one
world size saved intact. On the same world size each rank loads its own file. On another world
size (2 ranks -> 3) it loads all K files: every table's rows of every old rank are concatenated
and each table's shard keeps the keys it owns now (`shard_of(key, N)`, or the fixed table's plan), the
dense weights and optimizer come from old rank 0. A reader's position is a position in its
K-way byte range and means nothing in an N-way one: the readers restart at the start of the
oldest epoch an old rank was in (rows are seen again, none is skipped), and the trainer says so.
"""
from __future__ import annotations

import os
import re

import torch

from deeprec.checkpoint import checkpoint_step, list_checkpoints, load_checkpoint, verified_payload
from deeprec.errors import CheckpointError

_RANK_DIR = re.compile(r"^rank-(\d+)-of-(\d+)$")


def rank_dir(base: str, rank: int, world: int) -> str:
    return os.path.join(base, f"rank-{rank}-of-{world}")


def _worlds(base: str) -> dict[int, set[int]]:
    """World size -> the ranks that have a folder."""
    found: dict[int, set[int]] = {}
    for name in os.listdir(base) if os.path.isdir(base) else ():
        if (m := _RANK_DIR.match(name)) and int(m.group(1)) < int(m.group(2)):
            found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    return found


def _newest_complete(base: str, world: int) -> list[tuple[int, list[str]]]:
    """(step, paths of all ranks) for the steps every rank of `world` saved, newest first."""
    steps = None
    by_rank = []
    for rank in range(world):
        paths = {checkpoint_step(p): p for p in list_checkpoints(rank_dir(base, rank, world))}
        by_rank.append(paths)
        steps = set(paths) if steps is None else steps & set(paths)
    return [(s, [paths[s] for paths in by_rank]) for s in sorted(steps or (), reverse=True)]


def merge_rank_states(states: list[dict]) -> dict:
    """One state holding every rank's table rows (concatenated; each loading shard keeps its own
    rows) and rank 0's dense weights and optimizer."""
    merged = dict(states[0])
    model = dict(states[0]["model"])
    prefixes = [k[: -len("keys")] for k in model if k.endswith(".keys")]
    for name in model:
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is not None and model[name].dim() > 0:  # a per-row field of a sharded table
            model[name] = torch.cat([s["model"][name] for s in states])
    merged["model"] = model
    return merged


def restore_collective(base: str, rank: int, world: int) -> tuple[dict, list[str], bool, list[str]] | None:
    """The newest checkpoint of any world size as this rank's state: (state, paths read,
    whether the reader position applies (same world size), problems skipped), or None."""
    candidates = []
    for old_world, ranks in _worlds(base).items():
        if ranks == set(range(old_world)):
            candidates += [(step, old_world, paths) for step, paths in _newest_complete(base, old_world)]
    skipped = []
    for step, old_world, paths in sorted(candidates, key=lambda c: (c[0], c[1] == world), reverse=True):
        try:
            if old_world == world:  # every rank checks all files, so all agree on the step
                for path in paths:
                    if path != paths[rank]:
                        verified_payload(path)
                return load_checkpoint(paths[rank]), [paths[rank]], True, skipped
            states = [load_checkpoint(p) for p in paths]
        except CheckpointError as err:
            skipped.append(str(err))
            continue
        merged = merge_rank_states(states)
        merged["reader_epoch"] = min(int(s["reader"]["epoch"]) for s in states)
        return merged, paths, False, skipped
    if skipped:
        raise CheckpointError(f"no intact checkpoint of collective training: {'; '.join(skipped)}", base)
    return None


def one_process_state(model, state: dict) -> dict:
    """A merged collective checkpoint's model state (`restore_collective(base, 0, 1)`) in the layout
    of the unsharded `model`: each fixed table's rows, saved per rank as global row ids and values,
    written into its FusedLookup's weight (and optimizer slots); EmbeddingVariables load as saved."""
    from deeprec.nn.lookup import embedding_lookups

    out = dict(state)
    for name, lookup in embedding_lookups(model):
        if not lookup.holds_tables or lookup.hash_tables:  # EmbeddingVariables load as saved
            continue
        weight, slots, offset = lookup.weight.detach().clone(), {}, 0
        for t, feature in enumerate(lookup.features):
            prefix = f"{name}.variables.{t}."
            rows = out.pop(prefix + "keys").long() + offset
            weight[rows] = out.pop(prefix + "values")
            for key in [k for k in out if k.startswith(prefix + "slot.")]:
                value = out.pop(key)
                slot = slots.setdefault(key[len(prefix) + 5:], value.new_zeros((weight.shape[0], *value.shape[1:])))
                slot[rows] = value
            offset += feature.num_embeddings
        out[f"{name}.weight"] = weight
        out.update({f"{name}.slot_{slot}": value for slot, value in slots.items()})
        extra = out.get(f"{name}._extra_state") or {}
        out[f"{name}.optimizer_step"] = torch.tensor(int((extra.get("optimizer") or {}).get("step_count", 0)))
    return out
