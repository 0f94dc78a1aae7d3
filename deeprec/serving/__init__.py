"""Serving: load an export (`deeprec.serving.export`) and score raw batches.

    model = dr.serving.load("exports/dlrm")          # needs only deeprec and torch
    p = model({"I1": [3.0, None], "C1": ["68fd1e64", "8cf07265"], ...})   # JSON-friendly rows
    p = model(batch)                                  # or a reader's raw batch
"""
from __future__ import annotations

import json
import os
import warnings

import torch

from deeprec.atomic import sha256_file
from deeprec.data.collate import collate
from deeprec.data.schema import schema_from_dict
from deeprec.errors import ConfigError, DeepRecError
from deeprec.data.collate import batch_rows
from deeprec.serving.compiled import CompiledProgram, cpu_flags, package_name
from deeprec.serving.export import FORMAT, MANIFEST, PROGRAM, TABLES, export
from deeprec.serving.request import RequestError, request_batch
from deeprec.serving.request import is_columns as _is_json


class ServingError(DeepRecError):
    """An export that cannot be loaded (missing, corrupt, another format); names the file."""


class CompiledFallbackWarning(UserWarning):
    """An export scored by its ExportedProgram, not its compiled package; the message says why."""


class ServedModel:
    """An export, loaded: `model(batch)` -> probabilities [B] (or [B, T] for several labels).
    Scored by the export's compiled package for `device` (serving.compiled) where it has one that
    runs here, else by the ExportedProgram (a CompiledFallbackWarning names why)."""

    def __init__(self, path: str, device: str = "cpu"):
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
            self.compiled_devices = list(self.manifest.get("compiled", []))  # older exports: none
            for name in (PROGRAM, TABLES, *(package_name(d) for d in self.compiled_devices)):
                file = os.path.join(path, name)
                if not os.path.exists(file) or sha256_file(file) != digests[name]:
                    raise ServingError(f"{file}: missing or corrupt (its sha256 differs from the manifest)")
            self.path, self.step = path, int(self.manifest["step"])
            self.schema = schema_from_dict(self.manifest["schema"])
            self.labels = list(self.manifest["labels"])
            self.any_size = self.manifest.get("any_size") is True  # older exports: 1 row padded to 2
        except (KeyError, TypeError, ValueError) as err:  # a manifest without its checksums or fields
            raise ServingError(f"{manifest_path}: not a complete deeprec export manifest ({type(err).__name__}: "
                               f"{err}); export it again") from None
        from deeprec.ragged import Ragged

        with torch.serialization.safe_globals([Ragged]):  # the recorded example inputs hold Ragged batches
            self.module = torch.export.load(os.path.join(path, PROGRAM)).module()
        self.load_tables(os.path.join(path, TABLES))
        self.device = torch.device(device)
        self.compiled, self.compiled_reason = self._load_compiled()
        if self.compiled is None:
            warnings.warn(f"{path}: scoring with the ExportedProgram (slower): {self.compiled_reason}",
                          CompiledFallbackWarning, stacklevel=3)

    def _load_compiled(self) -> tuple[CompiledProgram | None, str]:
        """The AOTInductor package of this device bound to the module's tensors, or (None, why not)."""
        device = self.device.type
        if device not in self.compiled_devices:
            return None, (f"no compiled {device} package in the export (exported with compile=False, "
                          f"before deeprec wrote one, or on a machine without that device)")
        capability = self.manifest.get("cpu_capability")
        if device == "cpu" and capability != torch.backends.cpu.get_cpu_capability():  # its kernels use that ISA
            return None, (f"the package was compiled for CPU capability {capability}, this machine has "
                          f"{torch.backends.cpu.get_cpu_capability()}: export again here")
        lacking = sorted(set(self.manifest.get("cpu_flags", [])) - set(cpu_flags())) if device == "cpu" else []
        if lacking:  # compiled with -march=native there: an instruction this CPU lacks would kill the process
            return None, (f"the package was compiled on a CPU with instructions this one lacks "
                          f"({', '.join(lacking[:6])}{'...' if len(lacking) > 6 else ''}): export again here")
        if self.manifest.get("torch") != torch.__version__:
            return None, f"the package was compiled by torch {self.manifest.get('torch')}, this is {torch.__version__}"
        try:
            return CompiledProgram(os.path.join(self.path, package_name(device)), self.module, device), ""
        except Exception as err:  # whatever the loader raises: the ExportedProgram still scores
            return None, f"its package did not load ({type(err).__name__}: {err})"

    def recompiled(self) -> None:
        """After the module's tensors changed (an online update): a fresh runner bound to them, or
        the ExportedProgram (warned, naming why) if a shape left the compiled one."""
        if self.compiled is None:
            return
        why = self.compiled.fits(self.module)
        if why is None:
            try:
                self.compiled = self.compiled.rebound(self.module)
                return
            except Exception as err:
                why = f"{type(err).__name__}: {err}"
        self.compiled, self.compiled_reason = None, why
        warnings.warn(f"{self.path}: step {self.step} scored with the ExportedProgram (slower) until the next full "
                      f"export: {why}", CompiledFallbackWarning, stacklevel=2)

    def load_tables(self, file: str) -> None:
        """The weights from a safetensors file (the export's, or a newer one of the same shapes), mapped
        (serving.mapped: the module's tensors are views of a private mapping of the file, not copies,
        so processes serving one export share its pages); refused (ServingError) if any value is not finite."""
        from deeprec.serving.frozen import tie_shared
        from deeprec.serving.mapped import map_tensors

        try:
            mapped = map_tensors(file)
        except ValueError as err:
            raise ServingError(str(err)) from None
        tensors = tie_shared(self.module, self.manifest.get("shared", {}), mapped)  # older exports: {}
        check_finite(tensors, file)
        result = self.module.load_state_dict(tensors, strict=False, assign=True)  # the mapped tensors themselves
        if result.missing_keys:
            raise ServingError(f"{file}: lacks {', '.join(result.missing_keys[:5])}")

    def batch(self, rows: dict, path: str = "$", max_rows: int | None = None) -> dict:
        """A raw batch from columns {name: [value per row]} (lists, or 1-D numpy arrays), each value meaning
        what it means in a training file ("" and null missing, numbers as text accepted; a column left out
        all missing): `deeprec.serving.request`. A value that does not fit is a RequestError naming its
        JSON path (`path` is that of `rows`)."""
        return request_batch(self.schema, rows, path, max_rows)

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
        if self.compiled is not None:
            try:
                return self._score(self.compiled, batch, rows)
            except Exception as err:  # a package that loads but cannot run here: the traced program answers
                out = self._score(self.module, batch, rows)  # raises if the batch is at fault: the package stays
                self.compiled, self.compiled_reason = None, f"it failed when called ({type(err).__name__}: {err})"
                warnings.warn(f"{self.path}: scoring with the ExportedProgram (slower) from now on: "
                              f"{self.compiled_reason}", CompiledFallbackWarning, stacklevel=2)
                return out
        return self._score(self.module, batch, rows)

    def _score(self, program, batch: dict, rows: int) -> torch.Tensor:
        if self.any_size:
            return program(batch)["logits"].cpu()
        if any(_short(batch[c.name]) for c in self.schema.columns if c.kind == "sequence"):  # 0 or 1 ids: padded
            out = program(collate([batch, self._padding()]))["logits"][:rows]
        elif rows == 1:  # torch.export specializes sizes 0 and 1: score the row twice
            out = program({name: _twice(value) for name, value in batch.items()})["logits"][:1]
        else:
            out = program(batch)["logits"]
        return out.cpu()

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


def load(path: str, upto_step: int | None = None, device: str = "cpu") -> ServedModel:
    """An export folder (manifest.json inside), or a training run's export dir: its newest full
    export plus the deltas after it (up to `upto_step` if given). `device`: the compiled package
    that scores ("cuda": the export's CUDA package; scores come back on the CPU)."""
    if os.path.exists(os.path.join(path, MANIFEST)):
        return ServedModel(path, device)
    from deeprec.serving.online import ExportFolder

    if not os.path.isdir(path):
        raise ServingError(f"{path}: no such export")
    return ExportFolder(path, device=device).load(upto_step)


def _twice(value):
    """A 1-row column as 2 rows, the row repeated: what `collate([batch, batch])` gives, in a few
    tensor ops (collate's general path costs more than the compiled model at one row)."""
    from deeprec.ragged import Ragged

    if isinstance(value, Ragged):
        if int(value.offsets[0]) != 0:  # a slice of a larger batch: rebased by the general path
            return Ragged.cat([value, value])
        return Ragged(_twice(value.values), torch.cat([value.offsets, value.offsets[1:] + value.offsets[-1]]))
    return torch.cat([value, value])


def _short(value) -> bool:
    """A sequence column (a Ragged of ids, or of strings) holding fewer than 2 ids in all."""
    from deeprec.ragged import Ragged

    items = value.values if isinstance(value, Ragged) else None
    return items is not None and (items.rows if isinstance(items, Ragged) else items.shape[0]) < 2


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


__all__ = ["load", "export", "ServedModel", "ServingError", "RequestError", "CompiledFallbackWarning"]
