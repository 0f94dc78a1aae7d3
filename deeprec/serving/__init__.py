"""Serving: load an export (`deeprec.serving.export`) and score raw batches.

    model = dr.serving.load("exports/dlrm")          # needs only deeprec and torch
    p = model({"I1": [3.0, None], "C1": ["68fd1e64", "8cf07265"], ...})   # JSON-friendly rows
    p = model(batch)                                  # or a reader's raw batch
"""
from __future__ import annotations

import collections
import json
import os

import pyarrow as pa
import torch
from safetensors.torch import load_file

from deeprec.atomic import sha256_file
from deeprec.data.collate import collate
from deeprec.data.schema import schema_from_dict
from deeprec.errors import ConfigError, DeepRecError
from deeprec.data.collate import batch_rows
from deeprec.serving.export import FORMAT, MANIFEST, PROGRAM, TABLES, export


class ServingError(DeepRecError):
    """An export that cannot be loaded (missing, corrupt, another format); names the file."""


class RequestError(DeepRecError, ValueError):
    """A request that does not fit the model's schema; names the field."""


class ServedModel:
    """An export, loaded: `model(batch)` -> probabilities [B] (or [B, T] for several labels)."""

    def __init__(self, path: str):
        manifest_path = os.path.join(path, MANIFEST)
        try:
            with open(manifest_path) as f:
                self.manifest = json.load(f)
        except (OSError, ValueError) as err:
            raise ServingError(f"{manifest_path}: not a deeprec export ({err})") from None
        if self.manifest.get("format") != FORMAT:
            raise ServingError(f"{manifest_path}: format {self.manifest.get('format')!r}, this deeprec reads {FORMAT}")
        for name in (PROGRAM, TABLES):
            file = os.path.join(path, name)
            if not os.path.exists(file) or sha256_file(file) != self.manifest["sha256"][name]:
                raise ServingError(f"{file}: missing or corrupt (its sha256 differs from the manifest)")
        self.path, self.step = path, int(self.manifest["step"])
        self.schema = schema_from_dict(self.manifest["schema"])
        self.labels = list(self.manifest["labels"])
        from deeprec.ragged import Ragged

        with torch.serialization.safe_globals([Ragged]):  # the recorded example inputs hold Ragged batches
            self.module = torch.export.load(os.path.join(path, PROGRAM)).module()
        self.load_tables(os.path.join(path, TABLES))

    def load_tables(self, file: str) -> None:
        """The weights from a safetensors file (the export's, or a newer one of the same shapes)."""
        result = self.module.load_state_dict(load_file(file), strict=False)
        if result.missing_keys:
            raise ServingError(f"{file}: lacks {', '.join(result.missing_keys[:5])}")

    def batch(self, rows: dict) -> dict:
        """A raw batch from JSON-friendly columns {name: [value per row]} (labels may be left out)."""
        if not isinstance(rows, dict) or not rows:
            raise RequestError("the request must be an object of columns: {\"column\": [value per row], ...}")
        lengths = {name: len(v) for name, v in rows.items() if isinstance(v, list)}
        bad = [name for name, v in rows.items() if not isinstance(v, list)]
        if bad:
            raise RequestError(f"field {bad[0]!r}: must be a list (one value per row)")
        n = collections.Counter(lengths.values()).most_common(1)[0][0]  # the odd one out is named
        columns = {}
        for c in self.schema.columns:
            if c.kind == "ignore":
                continue
            values = rows.get(c.name)
            if values is None:
                if c.kind == "label":
                    values = [0.0] * n
                else:
                    raise RequestError(f"field {c.name!r} is missing (the model reads "
                                       f"{', '.join(x.name for x in self.schema.columns if x.kind not in ('label', 'ignore'))})")
            if len(values) != n:
                raise RequestError(f"field {c.name!r}: {len(values)} values, other fields have {n}")
            columns[c.name] = _arrow_column(c, values)
        unknown = sorted(set(rows) - {c.name for c in self.schema.columns})
        if unknown:
            raise RequestError(f"field {unknown[0]!r} is not a column of the model's schema")
        return self.schema.to_batch(pa.table(columns))

    @torch.no_grad()
    def logits(self, batch: dict) -> torch.Tensor:
        if _is_json(batch):
            batch = self.batch(batch)
        batch = dict(batch)
        try:
            rows = batch_rows(batch)
        except ConfigError:  # the runtime's wording is about splitting; a caller here sent no column
            raise RequestError("empty batch: no column holds rows (a tensor or Ragged per column)") from None
        for name in self.labels:  # the program takes every column; labels only feed the unused loss
            batch.setdefault(name, torch.zeros(rows))
        batch = {c.name: batch[c.name] for c in self.schema.columns if c.kind != "ignore"}
        if rows == 1:  # torch.export specializes sizes 0 and 1: score the row twice
            out = self.module(collate([batch, batch]))["logits"][:1]
        else:
            out = self.module(batch)["logits"]
        return out

    def __call__(self, batch: dict) -> torch.Tensor:
        return torch.sigmoid(self.logits(batch))


def load(path: str, upto_step: int | None = None) -> ServedModel:
    """An export folder (manifest.json inside), or a training run's export dir: its newest full
    export plus the deltas after it (up to `upto_step` if given)."""
    if os.path.exists(os.path.join(path, MANIFEST)):
        return ServedModel(path)
    from deeprec.serving.online import ExportFolder

    if not os.path.isdir(path):
        raise ServingError(f"{path}: no such export")
    return ExportFolder(path).load(upto_step)


def _is_json(batch: dict) -> bool:
    return any(isinstance(v, list) for v in batch.values())


def _arrow_column(c, values: list) -> pa.Array:
    try:
        if c.kind in ("label", "dense", "weight"):
            return pa.array([None if v is None else float(v) for v in values], pa.float32())
        if c.kind == "categorical" and c.dtype == "int":
            return pa.array([None if v is None else int(v) for v in values], pa.int64())
        if c.kind == "categorical":
            return pa.array([b"" if v is None else str(v).encode() for v in values], pa.binary())
        return pa.array(["" if v is None else (c.separator.join(map(str, v)) if isinstance(v, list) else str(v))
                         for v in values], pa.string())
    except (TypeError, ValueError, OverflowError) as err:
        raise RequestError(f"field {c.name!r}: {err}") from None


__all__ = ["load", "export", "ServedModel", "ServingError", "RequestError"]
