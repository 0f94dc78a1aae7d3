"""Export a trained model for serving: `dr.export(model, path)` / `deeprec export`.

    MODEL_DIR/
      program.pt2          torch.export ExportedProgram: raw batch (the reader's format) -> logits,
                           preprocessing (hashing, bucketizing, bags) included as deeprec ops
      tables.safetensors   the program's weights and constants: dense layers, embedding tables,
                           each EmbeddingVariable frozen into sorted keys + values (serving.frozen)
      program.cpu.pt2      the program compiled by AOTInductor (serving.compiled), no weights:
                           serving binds those of tables.safetensors (`compile=False`: not written)
      program.cuda.pt2     the same for CUDA, where a GPU is present
      manifest.json        format, model, step, schema, label columns, compiled devices, sha256 of each file,
                           the names of modules and tensors registered under several names (a shared
                           EmbeddingVariable: stored once, tied again on loading; serving.frozen.shared_names)

The batch dimension is dynamic (traced on a 5-row batch with uneven bags and sequences), every size
symbolic from 0 (`backed_size_oblivious`: torch.export would otherwise specialize sizes 0 and 1). Where
the program then scores 1 row, and sequences of 0 and 1 ids, exactly as the model does, the manifest
says `"any_size": true` and serving calls it as it is; else (a model whose trace still assumes a size
above 1) serving pads a 1-row request to 2 rows, as it does for older exports.
"""
from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

import torch
import torch.fx.experimental._config as fx_config
from safetensors.torch import save_file
from torch.export import Dim, ShapesCollection
from torch.utils._pytree import tree_leaves, tree_map

import deeprec
from deeprec.atomic import replace_dir, sha256_file
from deeprec.errors import ConfigError
from deeprec.data.schema import Schema, schema_to_dict
from deeprec.progress import progress as show_progress
from deeprec.serving import compile_cache
from deeprec.serving.compiled import cpu_flags, package_name
from deeprec.serving.example import example_batch
from deeprec.serving.frozen import freeze_variables, shared_names

FORMAT = 1
PROGRAM, TABLES, MANIFEST = "program.pt2", "tables.safetensors", "manifest.json"
STAGES = ("freezing variables", "tracing (torch.export)", "writing the program", "writing weights",
          "compiling (AOTInductor)")


def _dynamic_shapes(batch: dict) -> ShapesCollection:
    shapes = ShapesCollection()
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            shapes[t] = {0: Dim.AUTO}
    return shapes


def _trace(frozen: torch.nn.Module, batch: dict, any_size: bool = True) -> torch.export.ExportedProgram:
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=any_size):
        return torch.export.export(frozen, (batch,), dynamic_shapes=_dynamic_shapes(batch), strict=False)


def _any_size(program: torch.export.ExportedProgram, frozen: torch.nn.Module, schema: Schema) -> bool:
    """Whether the program scores 1 row, and sequences of 0 and 1 ids, bitwise as the model does (a
    trace may still hold a guard that a size is not 1, from a stride computed on the way: it refuses)."""
    module = program.module()
    for rows in (1, 2):  # example rows' sequences hold 0, 1, ... ids
        batch = example_batch(schema, rows)
        try:
            with torch.no_grad():
                got, want = tree_leaves(module(batch)), tree_leaves(frozen(batch))
        except Exception:  # noqa: BLE001 - a guard or a shape the program refuses: padded instead
            return False
        if len(got) != len(want) or not all(torch.equal(g, w) for g, w in zip(got, want)):
            return False
    return True


def _loads(file: str) -> bool:
    """Whether torch.export.load reads the program back: its deserializer refuses some traces with every
    size symbolic from 0 (DIN over hashed tables: "expected no unbacked symbols", a size it had replaced)."""
    from deeprec.ragged import Ragged

    try:
        with torch.serialization.safe_globals([Ragged]):
            torch.export.load(file)
    except Exception:  # noqa: BLE001 - whatever it raises, that trace cannot be served: the usual one is
        return False
    return True


def export(model: torch.nn.Module, path: str, *, schema: Schema | None = None, model_name: str | None = None,
           step: int = 0, progress=None, compile: bool | None = None) -> str:
    """Write a self-contained serving export of `model` to the folder `path` (replaced atomically).
    The model is not changed: a frozen copy is traced. `compile`: also the AOTInductor packages (CPU,
    and CUDA where a GPU is present; about 20-40 s each on 2 cores), which serving runs instead of
    the traced program (None: yes, unless $DEEPREC_EXPORT_COMPILE=0). `progress`: the stage under way
    shown on a terminal (None or True: deeprec.progress's shared console, False: never, or a rich
    Console)."""
    schema = schema or getattr(model, "schema", None)
    if schema is None:
        raise ValueError("export needs the data's schema: dr.export(model, path, schema=...)")
    if os.path.exists(path) and not os.path.isdir(path):  # before the work: an export is a folder
        raise ConfigError(f"--out {path} is a file: an export is a folder (give a new or an export's folder)")
    if compile is None:
        compile = compile_cache.compile_by_default()
    with show_progress("export", total=len(STAGES) - (not compile), unit="stages", rate=False, console=progress,
                       transient=True) as shown:
        shown.stage(STAGES[0])
        frozen = copy.deepcopy(model).eval()
        freeze_variables(frozen)
        batch = example_batch(schema)
        shown.stage(STAGES[1])
        try:
            program = _trace(frozen, batch)
        except Exception:  # noqa: BLE001 - a model the symbolic-from-0 trace cannot take: the usual one
            program = _trace(frozen, batch, any_size=False)
        # a program that refuses 1 row does so by a guard it checks at each call (never a wrong score):
        # it serves the padded 2 rows as the usual trace would
        any_size = _any_size(program, frozen, schema)
        shown.stage(STAGES[2])
        _write(program, model, path, schema, batch, model_name, step, shown, frozen, compile, any_size)
    return path


def _compile(frozen: torch.nn.Module, program, batch: dict, staging: str, held: contextlib.ExitStack,
             any_size: bool = False) -> dict[str, str | None]:
    """The AOTInductor packages into `staging`: CPU from `program`; CUDA from a trace of `frozen` on
    the GPU (preprocessing ops copy their ids to the host themselves). {device: the cache key to store
    the package under once it passed its check, or None where it came from the cache}; each key's
    cache lock is entered into `held`."""
    from deeprec.serving.compiled import compile_package, package_name

    compiled = {"cpu": compile_package(program, os.path.join(staging, package_name("cpu")), "cpu", held)}
    if torch.cuda.is_available():
        try:
            on_gpu = copy.deepcopy(frozen).to("cuda")
            gpu_batch = tree_map(lambda t: t.to("cuda") if isinstance(t, torch.Tensor) else t, batch)
            gpu_program = _trace(on_gpu, gpu_batch, any_size)  # traced as the CPU program was
            compiled["cuda"] = compile_package(gpu_program, os.path.join(staging, package_name("cuda")), "cuda", held)
        except Exception as err:  # the CPU package stands; serving on the GPU says why it has none
            warnings.warn(f"export: no CUDA package ({type(err).__name__}: {str(err).splitlines()[0]})", stacklevel=3)
    return compiled


def verify(export_dir: str, device: str, in_process: bool = False) -> str | None:
    """None if the package of `device` in `export_dir` loads and scores an example batch as the traced
    program does, else why not. In a child process (deeprec.serving.check_package: a loader that
    crashes must not take the exporting process down); `in_process` for a package from the cache,
    which loaded in such a child before, on this machine (then only the new weights are checked)."""
    if in_process:
        from deeprec.serving.check_package import check

        try:
            check(export_dir, device)
            return None
        except (Exception, SystemExit) as err:  # noqa: BLE001 - any failure: the package is left out
            return f"its test load failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    try:
        done = subprocess.run([sys.executable, "-m", "deeprec.serving.check_package", export_dir, device],
                              capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return "its test load did not finish in 600 s"
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or ["no message"])[-1]
    return f"its test load failed (exit {done.returncode}: {last})"


def _write_manifest(staging: str, manifest: dict) -> None:
    files = [PROGRAM, TABLES, *(package_name(d) for d in manifest["compiled"])]
    manifest["sha256"] = {name: sha256_file(os.path.join(staging, name)) for name in files}
    with open(os.path.join(staging, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)


def _check_room(folder: str, needed: int) -> None:
    """An OSError (ENOSPC) unless the folder's filesystem has `needed` bytes free: torch.export.save aborts
    the process (a C++ exception thrown in a destructor) when the disk fills under it, so the room the
    export's copies of its weights take (the program, the tables, a compiled package) is checked first."""
    stat = os.statvfs(folder)
    if stat.f_bavail * stat.f_frsize < needed:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), folder)


def _write(program, model, path: str, schema: Schema, batch: dict, model_name, step: int, shown,
           frozen: torch.nn.Module, compile: bool = True, any_size: bool = False) -> None:
    """The export's files into a staging folder, then swapped in for `path` (replace_dir)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        tensors = {**program.state_dict, **{k: v for k, v in program.constants.items() if isinstance(v, torch.Tensor)}}
        _check_room(staging, (2 + compile) * sum(t.numel() * t.element_size() for t in tensors.values()) + (1 << 20))
        torch.export.save(program, os.path.join(staging, PROGRAM))
        if not _loads(os.path.join(staging, PROGRAM)):  # some symbolic-from-0 traces do not: the usual one
            program, any_size = _trace(frozen, batch, any_size=False), False
            torch.export.save(program, os.path.join(staging, PROGRAM))
        shown.stage(STAGES[3])
        tensors, shared = shared_names(frozen, tensors)  # a module under several names: stored once
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, os.path.join(staging, TABLES))
        with contextlib.ExitStack() as held:  # the compile cache's locks, until the packages are stored
            compiled = {}
            if compile:
                shown.stage(STAGES[4])
                compiled = _compile(frozen, program, batch, staging, held, any_size)
            manifest = {"format": FORMAT, "model": model_name or type(model).__name__.lower(), "step": int(step),
                        "schema": schema_to_dict(schema), "labels": list(getattr(model, "label_columns", ("label",))),
                        "inputs": sorted(batch), "compiled": list(compiled), "shared": shared,
                        "any_size": any_size,  # 1 row scored as it is, not padded
                        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the ISA the .so's kernels use
                        "cpu_flags": cpu_flags(),  # -march=native: the package may use any of them
                        "deeprec": deeprec.__version__, "torch": torch.__version__}
            _write_manifest(staging, manifest)
            for device, key in compiled.items():  # each package loaded and run once before it is listed
                why = verify(staging, device, in_process=key is None)
                if why is not None:
                    warnings.warn(f"export: the {device} package is left out, serving runs the traced program: {why}",
                                  stacklevel=3)
                    os.unlink(os.path.join(staging, package_name(device)))
                    manifest["compiled"] = [d for d in manifest["compiled"] if d != device]
                    _write_manifest(staging, manifest)
                elif key is not None:
                    compile_cache.store(key, os.path.join(staging, package_name(device)))
        replace_dir(staging, path)  # every file fsynced, then renamed in (an older export aside, then dropped)
        shown.advance()  # the last stage done
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a failed export leaves neither a half folder nor the staging
        raise


__all__ = ["export", "example_batch", "FORMAT"]
