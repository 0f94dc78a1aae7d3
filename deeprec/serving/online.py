"""Online updates: full exports and incremental deltas in one folder, and a reader that follows it.

    EXPORT_DIR/
      full-<step>/                       a full export (deeprec.serving.export)
      delta-<step>.safetensors           EmbeddingVariable rows updated since the previous export
                                         ("<module path>.keys" / ".values") + every dense weight
      delta-<step>.json                  {"format", "step", "after": previous export's step, "bytes", "sha256"}

The trainer writes them (`--export-dir D --export-every N --export-incremental-every M`), each
atomically (deeprec.atomic: temporary name, fsync, rename; a delta's .json comes last and makes it visible).
`deeprec serve D` loads the newest full export plus its chain of deltas and, while it runs,
applies new deltas (or a newer full export) on a copy of the model, then swaps it in between
two batches: a request is never scored by a half-applied model.

Keys evicted from a training EmbeddingVariable stay in the served index until the next full export.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re
import shutil

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from deeprec.atomic import sha256_file, write_with_manifest
from deeprec.errors import ExportError
from deeprec.serving import compile_cache
from deeprec.serving.export import FORMAT, export
from deeprec.serving.frozen import merged

log = logging.getLogger("deeprec.serving")
_FULL = re.compile(r"^full-(\d+)$")
_DELTA = re.compile(r"^delta-(\d+)\.json$")
# safetensors' save_file writes through a temporary of its own (Rust's tempfile: ".tmp" + 6 characters) in
# the target's folder, renamed onto our temporary: a writer killed inside it leaves that name behind
_STALE = re.compile(r"^(\.delta-\d+\.(json|safetensors)-.*\.tmp|\.tmp[A-Za-z0-9]{6}|\.export-.*|full-\d+\.old-\d+)$")


def remove_stale_temporaries(directory: str) -> list[str]:
    """What a killed writer left in an export dir (a delta's temporary file, safetensors' own, a full
    export's staging folder, an older full export set aside): serving never reads those names; a new writer (the one
    writer of the folder, before it writes) removes them."""
    stale = [os.path.join(directory, n) for n in os.listdir(directory) if _STALE.match(n)]
    for path in stale:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        log.warning("removed %s, left by an interrupted export", path)
    return stale


def _variables(model: torch.nn.Module) -> dict:
    from deeprec.nn.variable import EmbeddingVariable

    return {name: m for name, m in model.named_modules() if isinstance(m, EmbeddingVariable)}


@contextlib.contextmanager
def export_errors(directory: str, step: int, flag: str = "--export-dir"):
    """An export that cannot be written (a full disk): an ExportError naming the folder (as `flag`), the
    step and the OS error, for the trainer to end the run with after its checkpoint, or `deeprec
    export` with its one line (docs/reliability.md)."""
    try:
        yield
    except OSError as err:
        raise ExportError(directory, step, err, flag) from None
    except SafetensorError as err:  # safetensors' own error for a failed write: "... (os error 28)"
        code = re.search(r"\(os error (\d+)\)", str(err))
        if code is None:
            raise
        raise ExportError(directory, step, OSError(int(code[1]), os.strerror(int(code[1]))), flag) from None


class ExportWriter:
    """Writes a training model's full exports and deltas into `directory`."""

    def __init__(self, directory: str, model: torch.nn.Module, schema, model_name: str, keep: int = 2,
                 compile: bool | None = None):
        self.directory, self.model, self.schema, self.model_name, self.keep = directory, model, schema, model_name, keep
        # DEEPREC_EXPORT_COMPILE read (and a bad value refused) now, not at the first export hours later
        self.compile = compile_cache.compile_by_default() if compile is None else compile
        self.last_step: int | None = None
        self._marks: dict[str, int] = {}  # EmbeddingVariable -> its global_step at the last export
        os.makedirs(directory, exist_ok=True)
        remove_stale_temporaries(directory)


    def _mark(self) -> None:
        self._marks = {name: ev.global_step for name, ev in _variables(self.model).items()}

    def full(self, step: int) -> str:
        with export_errors(self.directory, step):
            return self._full(step)

    def delta(self, step: int) -> str:
        """The rows updated since the last export, and the dense weights (a full export if none yet)."""
        with export_errors(self.directory, step):
            return self._full(step) if self.last_step is None else self._delta(step)

    def _full(self, step: int) -> str:
        path = export(self.model, os.path.join(self.directory, f"full-{step:09d}"), schema=self.schema,
                      model_name=self.model_name, step=step, compile=self.compile)
        self._mark()
        self.last_step = step
        fulls = sorted(n for n in os.listdir(self.directory) if _FULL.match(n))
        for old in fulls[:-self.keep]:  # with the deltas only they need
            shutil.rmtree(os.path.join(self.directory, old), ignore_errors=True)
        oldest = int(_FULL.match(fulls[-self.keep:][0]).group(1))
        for name in os.listdir(self.directory):
            m = re.match(r"^delta-(\d+)\.(json|safetensors)$", name)
            if m and int(m.group(1)) <= oldest:
                os.unlink(os.path.join(self.directory, name))
        return path

    def _delta(self, step: int) -> str:
        tensors = {}
        variables = _variables(self.model)
        for name, ev in variables.items():
            tensors[f"{name}.keys"], tensors[f"{name}.values"] = ev.snapshot(after_version=self._marks.get(name, -1))
        for name, t in [*self.model.named_parameters(), *self.model.named_buffers()]:
            tensors[name] = t.detach().clone().contiguous()
        base = os.path.join(self.directory, f"delta-{step:09d}")
        try:
            write_with_manifest(base + ".safetensors", base + ".json", lambda tmp: save_file(tensors, tmp),
                                {"format": FORMAT, "step": step, "after": self.last_step,
                                 "variables": sorted(variables),
                                 "rows": sum(int(tensors[f"{n}.keys"].numel()) for n in variables)})
        except OSError:
            if os.path.exists(base + ".safetensors") and not os.path.exists(base + ".json"):
                os.unlink(base + ".safetensors")  # a payload its manifest could not follow
            raise
        self._mark()
        self.last_step = step
        return base + ".safetensors"


def _read_delta(path: str, after_step: int) -> tuple[dict, dict]:
    """(manifest, tensors) of the delta at `path` (its .json), checked: complete (its payload's sha256),
    following `after_step`, every value finite. A ServingError otherwise."""
    from deeprec.serving import ServingError, check_finite

    try:
        with open(path) as f:
            manifest = json.load(f)
        digest, after, variables = manifest["sha256"], manifest["after"], list(manifest["variables"])
        int(manifest["step"])
    except (ValueError, KeyError, TypeError) as err:
        raise ServingError(f"{path}: not a delta manifest ({type(err).__name__}: {err})") from None
    tensors_path = path[: -len(".json")] + ".safetensors"
    if not os.path.isfile(tensors_path):
        raise ServingError(f"{tensors_path}: missing (the delta {path} names it)")
    if sha256_file(tensors_path) != digest:
        raise ServingError(f"{tensors_path}: corrupt (its sha256 differs from {path})")
    if after != after_step:
        raise ServingError(f"{path} follows step {after}, the model served is at step {after_step}")
    tensors = load_file(tensors_path)
    check_finite(tensors, tensors_path)  # a NaN row or weight would turn every score to NaN
    manifest["variables"] = variables
    return manifest, tensors


def _merge_delta(module: torch.nn.Module, manifest: dict, tensors: dict, path: str) -> None:
    """The delta's rows and dense weights into `module` (a copy), all checked before the first change:
    a ServingError leaves `module` as it was."""
    from deeprec.serving import ServingError

    rows = []
    for name in manifest["variables"]:
        try:
            rows.append((module.get_submodule(name), tensors.pop(f"{name}.keys"), tensors.pop(f"{name}.values")))
        except (AttributeError, KeyError) as err:
            raise ServingError(f"{path}: variable {name!r} is not in the served model or the delta ({err})") from None
    for (frozen, keys, values), name in zip(rows, manifest["variables"]):  # a chain merges into one copy:
        dim = frozen.values.shape[1]  # a row error found while merging would leave it half-changed
        if keys.dim() != 1 or keys.is_floating_point() or list(values.shape) != [keys.shape[0], dim]:
            raise ServingError(f"{path}: variable {name!r}: {list(keys.shape)} keys and {list(values.shape)} values, "
                               f"expected [n] integer keys and [n, {dim}] values")
    known = dict(module.state_dict())
    dense = {k: v for k, v in tensors.items() if k in known}
    wrong = [k for k, v in dense.items() if v.shape != known[k].shape]
    if wrong:
        raise ServingError(f"{path}: {wrong[0]} has shape {tuple(dense[wrong[0]].shape)}, the served model's is "
                           f"{tuple(known[wrong[0]].shape)}")
    for frozen, new_keys, new_values in rows:
        keys, values = merged(frozen.sorted_keys, frozen.values, new_keys, new_values, float(frozen.missing_value))
        frozen.sorted_keys, frozen.values = keys, values  # the graph reads them by name, whatever their size
    # new tensors, never written into the old ones: those are shared with the model serving now (_copy).
    # A tensor under several names (tied weights) is in a delta once: every name of it takes the new one
    names = {}
    for k, t in known.items():
        names.setdefault(_identity(t), []).append(k)
    update = {}
    for k, v in dense.items():
        new = v.to(known[k].dtype, copy=True)
        update.update({name: new for name in names[_identity(known[k])]} if known[k].numel() else {k: new})
    module.load_state_dict(update, strict=False, assign=True)


def _identity(t: torch.Tensor) -> tuple:
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


def _copy(served):
    """A copy of `served` to update: its own module structure, the same tensors (an update replaces a
    tensor, never writes into it: _merge_delta). A table no delta touched stays the one mapped from
    the export (serving.mapped), shared with the model serving now and with the other processes."""
    updated = copy.copy(served)
    module = served.module
    shared = {id(t): t for t in (*module.parameters(), *module.buffers())}  # deepcopy's memo: kept as they are
    updated.module = copy.deepcopy(module, shared)
    return updated


def apply_deltas(served, paths: list[str]):
    """(a copy of `served` with the deltas `paths` (their .json) applied in order, the paths applied,
    (path, ServingError) of the first refused or None). One copy and one re-binding of the compiled
    program for the whole chain (about 80 ms a delta otherwise: a server behind by a backlog of
    deltas, as after a restart, would never catch up with a trainer writing one every few steps).
    A delta is refused (corrupt, not following, a non-finite value) before it changes anything;
    the chain stops there. `served` is never changed."""
    from deeprec.serving import ServingError

    updated, applied, refused = None, [], None
    for path in paths:
        try:
            manifest, tensors = _read_delta(path, served.step if updated is None else updated.step)
            candidate = updated if updated is not None else _copy(served)
            _merge_delta(candidate.module, manifest, tensors, path)
        except ServingError as err:
            refused = (path, err)
            break
        updated = candidate
        updated.step = int(manifest["step"])
        applied.append(path)
    if updated is None:
        return served, applied, refused
    updated.recompiled()  # its compiled program bound to the new tensors (or the ExportedProgram, warned)
    return updated, applied, refused


def apply_delta(served, path: str):
    """A copy of `served` (a ServedModel) with the delta at `path` (its .json) applied. A ServingError
    (the delta refused, `served` untouched) if it is corrupt, does not follow `served`, or holds a
    non-finite value."""
    updated, _, refused = apply_deltas(served, [path])
    if refused is not None:
        raise refused[1]
    return updated


class ExportFolder:
    """The newest full export of a folder plus its deltas; `refresh` follows new ones.

    Strict by default (`dr.serving.load`): a bad export or delta raises ServingError. With
    `lenient=True` (the server) a bad one is refused instead: recorded in `refused` (path -> why, in
    order; never tried again), and the model stays at the last good version. `check(model)` -> why
    not, or None: a last test of each new model before it is taken (the server's probe prediction)."""

    def __init__(self, directory: str, lenient: bool = False, check=None, device: str = "cpu"):
        self.directory, self.lenient, self.check, self.device = directory, lenient, check, device
        self.refused: dict[str, str] = {}

    def _fulls(self) -> list[tuple[int, str]]:
        return sorted((int(m.group(1)), n) for n in os.listdir(self.directory) if (m := _FULL.match(n))
                      and os.path.join(self.directory, n) not in self.refused)

    def _deltas(self, after: int) -> list[str]:
        found = sorted((int(m.group(1)), n) for n in os.listdir(self.directory) if (m := _DELTA.match(n)))
        return [p for step, n in found if step > after and (p := os.path.join(self.directory, n)) not in self.refused]

    def _refuse(self, path: str, err: Exception) -> None:
        if not self.lenient:
            raise err
        self.refused[path] = str(err)

    def _checked(self, model, path: str):
        from deeprec.serving import ServingError

        why = self.check(model) if self.check is not None else None
        if why is not None:
            raise ServingError(f"{path}: {why}")
        return model

    def _full(self, name: str):
        from deeprec.serving import ServedModel, ServingError

        path = os.path.join(self.directory, name)
        try:
            return self._checked(ServedModel(path, self.device), path)
        except ServingError as err:
            self._refuse(path, err)
            return None

    def load(self, upto_step: int | None = None):
        from deeprec.serving import ServingError

        fulls = [(s, n) for s, n in self._fulls() if upto_step is None or s <= upto_step]
        if not fulls:
            raise ServingError(f"{self.directory}: no full export (full-<step>/) yet")
        for _, name in reversed(fulls):  # lenient: an older full export if the newest is refused
            served = self._full(name)
            if served is not None:
                return self._follow(served, upto_step)
        raise ServingError(f"{self.directory}: every full export was refused: "
                           + "; ".join(self.refused[os.path.join(self.directory, n)] for _, n in fulls))

    def _follow(self, served, upto_step: int | None = None):
        from deeprec.serving import ServingError

        paths = [p for p in self._deltas(served.step)
                 if upto_step is None or int(_DELTA.match(os.path.basename(p)).group(1)) <= upto_step]
        if not paths:
            return served
        updated, applied, refused = apply_deltas(served, paths)
        if applied:
            try:
                updated = self._checked(updated, applied[-1])
            except ServingError:  # the chain's model fails its check: one delta at a time finds which
                updated, refused = self._follow_one_by_one(served, applied), None
        if refused is not None:  # lenient: the deltas after it follow a step never served: refused too
            self._refuse(*refused)
        return updated

    def _follow_one_by_one(self, served, paths: list[str]):
        from deeprec.serving import ServingError

        for path in paths:
            try:
                served = self._checked(apply_delta(served, path), path)
            except ServingError as err:
                self._refuse(path, err)
                break
        return served

    def refresh(self, served):
        """A newer model than `served` (a newer full export, or new deltas applied), or None."""
        fulls = self._fulls()
        if fulls and fulls[-1][0] > served.step:
            full = self._full(fulls[-1][1])
            if full is not None:
                return self._follow(full)
        if self._deltas(served.step):
            newer = self._follow(served)
            return newer if newer is not served else None
        return None
