"""Serving: load an export (`deeprec.serving.export`) and score raw batches.

    model = dr.serving.load("exports/dlrm")          # needs only deeprec and torch
    p = model({"I1": [3.0, None], "C1": ["68fd1e64", "8cf07265"], ...})   # JSON-friendly rows
    p = model(batch)                                  # or a reader's raw batch
"""
from __future__ import annotations

import collections
import json
import os
import re

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import load_file

from deeprec.atomic import sha256_file
from deeprec.data.collate import collate
from deeprec.data.schema import schema_from_dict, split_sequence
from deeprec.errors import ConfigError, DeepRecError
from deeprec.data.collate import batch_rows
from deeprec.serving.export import FORMAT, MANIFEST, PROGRAM, TABLES, export


class ServingError(DeepRecError):
    """An export that cannot be loaded (missing, corrupt, another format); names the file."""


class RequestError(DeepRecError, ValueError):
    """A request that does not fit the model's schema: `str(err)` is "PATH: what is wrong", PATH the
    JSON path of the offending value (`$.inputs.I5[3]`); `err.path` and `err.reason` apart."""

    def __init__(self, reason: str, path: str = "$"):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


class ServedModel:
    """An export, loaded: `model(batch)` -> probabilities [B] (or [B, T] for several labels)."""

    def __init__(self, path: str):
        manifest_path = os.path.join(path, MANIFEST)
        try:
            with open(manifest_path) as f:
                self.manifest = json.load(f)
        except (OSError, ValueError) as err:
            raise ServingError(f"{manifest_path}: not a deeprec export ({err})") from None
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT:
            found = self.manifest.get("format") if isinstance(self.manifest, dict) else None
            raise ServingError(f"{manifest_path}: format {found!r}, this deeprec reads {FORMAT}")
        try:
            digests = self.manifest["sha256"]
            for name in (PROGRAM, TABLES):
                file = os.path.join(path, name)
                if not os.path.exists(file) or sha256_file(file) != digests[name]:
                    raise ServingError(f"{file}: missing or corrupt (its sha256 differs from the manifest)")
            self.path, self.step = path, int(self.manifest["step"])
            self.schema = schema_from_dict(self.manifest["schema"])
            self.labels = list(self.manifest["labels"])
        except (KeyError, TypeError, ValueError) as err:  # a manifest without its checksums or fields
            raise ServingError(f"{manifest_path}: not a complete deeprec export manifest ({type(err).__name__}: "
                               f"{err}); export it again") from None
        from deeprec.ragged import Ragged

        with torch.serialization.safe_globals([Ragged]):  # the recorded example inputs hold Ragged batches
            self.module = torch.export.load(os.path.join(path, PROGRAM)).module()
        self.load_tables(os.path.join(path, TABLES))

    def load_tables(self, file: str) -> None:
        """The weights from a safetensors file (the export's, or a newer one of the same shapes);
        refused (ServingError) if any value is not finite."""
        tensors = load_file(file)
        check_finite(tensors, file)
        result = self.module.load_state_dict(tensors, strict=False)
        if result.missing_keys:
            raise ServingError(f"{file}: lacks {', '.join(result.missing_keys[:5])}")

    def batch(self, rows: dict, path: str = "$", max_rows: int | None = None) -> dict:
        """A raw batch from JSON-friendly columns {name: [value per row]} (labels may be left out).
        A value that does not fit is a RequestError naming its JSON path (`path` is that of `rows`)."""
        if not isinstance(rows, dict) or not rows:
            raise RequestError("the request must be an object of columns: {\"column\": [value per row], ...}", path)
        bad = [name for name, v in rows.items() if not isinstance(v, list)]
        if bad:
            raise RequestError(f"field {bad[0]!r}: must be a list (one value per row), got {_shown(rows[bad[0]])}",
                               _key(path, bad[0]))
        names = {c.name for c in self.schema.columns}
        unknown = [name for name in rows if name not in names]
        if unknown:
            raise RequestError(f"field {unknown[0]!r} is not a column of the model's schema (its columns: "
                               f"{', '.join(self._inputs())})", _key(path, unknown[0]))
        n = collections.Counter(len(v) for v in rows.values()).most_common(1)[0][0]  # the odd one out is named
        for c in self.schema.columns:
            if c.kind == "ignore" or (c.kind == "label" and c.name not in rows):
                continue
            values = rows.get(c.name)
            if values is None:
                raise RequestError(f"field {c.name!r} is missing (the model reads {', '.join(self._inputs())})",
                                   _key(path, c.name))
            if len(values) != n:
                raise RequestError(f"field {c.name!r}: {len(values)} values, other fields have {n}", _key(path, c.name))
        if n == 0:
            raise RequestError("0 rows: a request needs at least one row (each field a list of one value per row)",
                               path)
        if max_rows is not None and n > max_rows:
            raise RequestError(f"{n} rows, this server takes at most {max_rows} per request (--max-rows): "
                               f"split the request", path)
        columns = {}
        for c in self.schema.columns:
            if c.kind == "ignore":
                continue
            values = rows.get(c.name)
            columns[c.name] = _arrow_column(c, [0.0] * n if values is None else values, _key(path, c.name))
        try:
            return self.schema.to_batch(pa.table(columns))
        except (DeepRecError, pa.ArrowException, ValueError, TypeError, OverflowError) as err:  # checked above
            raise RequestError(f"the values do not fit the model's schema ({err})", path) from None

    def _inputs(self) -> list[str]:
        return [x.name for x in self.schema.columns if x.kind not in ("label", "ignore")]

    def probe(self) -> str | None:
        """None if the model answers a request (2 rows, every value missing) with finite scores, else why not."""
        rows = {name: [None, None] for name in self._inputs()}
        try:
            scores = self(rows)
        except Exception as err:  # whatever the model raises: it cannot answer
            return f"a probe prediction failed: {type(err).__name__}: {err}"
        if scores.shape[0] != 2 or not bool(torch.isfinite(scores).all()):
            return "a probe prediction gave non-finite scores"
        return None

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
        if any(_short(batch[c.name]) for c in self.schema.columns if c.kind == "sequence"):  # 0 or 1 ids: padded
            out = self.module(collate([batch, self._padding()]))["logits"][:rows]
        elif rows == 1:  # torch.export specializes sizes 0 and 1: score the row twice
            out = self.module(collate([batch, batch]))["logits"][:1]
        else:
            out = self.module(batch)["logits"]
        return out

    def _padding(self) -> dict:
        """2 rows whose every sequence holds 2 ids, scored after a request's rows and dropped:
        torch.export specializes a sequence column's id count of 0 and 1 as it does the batch size
        (rows are scored independently: the request's scores are those it would get alone)."""
        if getattr(self, "_pad", None) is None:
            pad = {}
            for c in self.schema.columns:
                if c.kind in ("label", "dense", "weight"):
                    pad[c.name] = [0.0, 0.0]
                elif c.kind == "categorical":
                    pad[c.name] = [11, 11] if c.dtype == "int" else ["pad", "pad"]
                elif c.kind == "sequence":
                    pad[c.name] = [[11, 11], [11, 11]]
            self._pad = self.batch(pad)
        return self._pad

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


def _short(value) -> bool:
    """A sequence column (a Ragged of ids, or of strings) holding fewer than 2 ids in all."""
    from deeprec.ragged import Ragged

    items = value.values if isinstance(value, Ragged) else None
    return items is not None and (items.rows if isinstance(items, Ragged) else items.shape[0]) < 2


def _is_json(batch: dict) -> bool:
    return any(isinstance(v, list) for v in batch.values())


_FLOAT32_MAX = float(np.finfo(np.float32).max)
_ID_TYPES = (str, int, float)  # a sequence item (bool is an int: accepted, as str(True))


def _key(path: str, name: str) -> str:
    """`path` + the object key `name`, as a JSON path: $.inputs.I5, or $.inputs["odd name"]."""
    return f"{path}.{name}" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) else f"{path}[{json.dumps(name)}]"


def _shown(value) -> str:
    """A value as an error names it: JSON text, cut short, or its JSON type for containers."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, float) and not np.isfinite(value):
        text = "nan" if value != value else ("inf" if value > 0 else "-inf")
    else:
        text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _first_bad(values: list, convert) -> tuple[int, object]:
    for i, v in enumerate(values):
        try:
            convert(v)
        except (TypeError, ValueError, OverflowError):
            return i, v
    return -1, None


def _arrow_column(c, values: list, path: str) -> pa.Array:
    """One column of a request as the reader would give it; a bad value is a RequestError at its path."""
    field = f"field {c.name!r}"
    if c.kind in ("label", "dense", "weight"):
        wanted = "a finite number (float32: |x| <= 3.4e38), a numeric string or null"
        try:
            floats = [None if v is None else float(v) for v in values]
            array = pa.array(floats, pa.float32())
        except (TypeError, ValueError, OverflowError, pa.ArrowException):
            i, v = _first_bad(values, lambda v: v is None or float(v))
            raise RequestError(f"{field}: expected {wanted}, got {_shown(v)}", f"{path}[{max(i, 0)}]") from None
        if array.null_count < len(array):  # NaN is missing (as the reader reads it); inf and beyond float32 are not
            inf = np.isinf(array.to_numpy(zero_copy_only=False))
            if inf.any():
                i = int(np.flatnonzero(inf)[0])
                beyond = "" if np.isinf(floats[i]) else " (beyond float32's range)"
                raise RequestError(f"{field}: expected {wanted}, got {_shown(values[i])}{beyond}", f"{path}[{i}]")
        return array
    if c.kind == "categorical" and c.dtype == "int":
        try:
            return pa.array([None if v is None else int(v) for v in values], pa.int64())
        except (TypeError, ValueError, OverflowError, pa.ArrowException):
            i, v = _first_bad(values, lambda v: v is None or _int64(int(v)))
            raise RequestError(f"{field}: expected an integer id (int64) or null, got {_shown(v)}",
                               f"{path}[{max(i, 0)}]") from None
    if c.kind == "categorical":
        for i, v in enumerate(values):
            if isinstance(v, (list, dict)):
                raise RequestError(f"{field}: expected an id (a string or a number) or null, got {_shown(v)}",
                                   f"{path}[{i}]")
        try:
            return pa.array([b"" if v is None else str(v).encode() for v in values], pa.binary())
        except (TypeError, ValueError, OverflowError) as err:  # a lone surrogate
            i, v = _first_bad(values, lambda v: v is None or str(v).encode())
            raise RequestError(f"{field}: {err}", f"{path}[{max(i, 0)}]") from None
    return _sequence_column(c, values, path)


def _int64(value: int) -> int:
    if not -2 ** 63 <= value < 2 ** 63:
        raise OverflowError("beyond int64")
    return value


def _sequence_column(c, values: list, path: str) -> pa.Array:
    """A sequence: per row a list of ids, the ids joined by the column's separator as one string, or null."""
    field, sep = f"field {c.name!r}", c.separator
    wanted = (f"a list of {'integer ids' if c.dtype == 'int' else 'ids (strings or numbers)'}, "
              f"a string of ids joined by {sep!r}, or null")
    texts = []
    for i, v in enumerate(values):
        if v is None:
            texts.append("")
        elif isinstance(v, list):
            for j, item in enumerate(v):
                if not isinstance(item, _ID_TYPES) or (isinstance(item, str) and sep in item):
                    why = f"an id containing the separator {sep!r}" if isinstance(item, str) else _shown(item)
                    raise RequestError(f"{field}: a sequence holds ids, got {why} (expected {wanted})",
                                       f"{path}[{i}][{j}]")
            texts.append(sep.join(map(str, v)))
        elif isinstance(v, dict):
            raise RequestError(f"{field}: expected {wanted}, got {_shown(v)}", f"{path}[{i}]")
        else:
            texts.append(str(v))
    try:
        array = pa.array(texts, pa.string())
    except (TypeError, ValueError) as err:  # a lone surrogate
        i, _ = _first_bad(texts, lambda t: t.encode())
        raise RequestError(f"{field}: {err}", f"{path}[{max(i, 0)}]") from None
    if c.dtype == "int":  # each id must read as an int64 (as the reader casts it)
        try:
            split_sequence(array, c)
        except (DeepRecError, pa.ArrowException):
            raise _bad_int_sequence(c, values, texts, path) from None
    return array


def _bad_int_sequence(c, values: list, texts: list, path: str) -> RequestError:
    """The error of the first row of an int sequence column holding an id that is not an int64."""
    sep = c.separator
    for i, text in enumerate(texts):
        items = text.split(sep) if text else []
        first = max(0, len(items) - c.max_length) if c.max_length else 0  # the reader keeps the last max_length
        j = next((j for j in range(first, len(items)) if _not_int64(items[j])), None)
        if j is None:
            continue
        if isinstance(values[i], list):
            return RequestError(f"field {c.name!r}: expected integer ids (int64), got {_shown(values[i][j])}",
                                f"{path}[{i}][{j}]")
        return RequestError(f"field {c.name!r}: expected integer ids (int64) joined by {sep!r}, got "
                            f"{_shown(values[i])} (id {j + 1}: {items[j]!r})", f"{path}[{i}]")
    return RequestError(f"field {c.name!r}: expected integer ids (int64)", path)


def _not_int64(text: str) -> bool:
    try:
        pa.array([text], pa.string()).cast(pa.int64())
        return False
    except pa.ArrowException:
        return True


def check_finite(tensors: dict, source: str) -> None:
    """ServingError naming the first tensor of `tensors` that holds a NaN or an infinity."""
    for name, t in tensors.items():
        if not t.is_floating_point():
            continue
        flat = t.reshape(-1)
        for start in range(0, flat.numel(), 1 << 24):  # bounded temporaries on large tables
            chunk = flat[start:start + (1 << 24)]
            if not bool(torch.isfinite(chunk).all()):
                bad = int((~torch.isfinite(flat)).sum())
                raise ServingError(f"{source}: {name} holds {bad} non-finite value(s) (NaN or inf) of "
                                   f"{flat.numel()}: refused")


__all__ = ["load", "export", "ServedModel", "ServingError", "RequestError"]
