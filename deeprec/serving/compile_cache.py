"""Compiled packages kept for the next export of the same program: AOTInductor takes 20-60 s on 2
cores, and a model exported again (every full export while training, a re-export of a checkpoint)
is most often the same graph on the same shapes with new weights, which the package does not hold
for serving (serving.compiled binds the export's own tensors).

    export ──program_key(program)──> DEEPREC_CACHE/compiled/<key>.pt2 ──there──> copied (no compile)
                                                                     └absent──> compiled, verified in a
                                                                                child, then stored here

An export holds the key's lock (claimed: <key>.lock, flock) from the lookup until its packages are
checked and stored, so that a second export of the same program at the same time (another process: a
re-export while training exports, test workers) waits for the first one's package instead of compiling
it too. A lock file goes with its evicted entry (at worst a program is then compiled twice).

The key is what the package depends on: the graph's code, every node's shape, dtype and stride, the
shapes of the weights (and the values of the small ones, which inductor may fold in), torch, the
deeprec ops' library, inductor's options and this CPU's flags. Only a package that passed the
export's check is stored; a copied one is checked again against the new weights. The newest
MAX_ENTRIES are kept.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import sys

import torch

MAX_ENTRIES = 16
_SMALL = 64  # weights of at most this many values enter the key by value (a folded scalar is never stale)
# inductor's variables that say where and how it works, not what it generates; inductor itself sets
# TORCHINDUCTOR_CACHE_DIR in the environment at its first compile, which made a process's later keys differ
_WHERE_NOT_WHAT = ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE",
                   "TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_WORKER_START")


def cache_folder() -> str:
    from deeprec.data.stores import cache_root

    return os.path.join(cache_root(), "compiled")


COMPILE_VARIABLE = "DEEPREC_EXPORT_COMPILE"
_SWITCH = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def compile_by_default() -> bool:
    """Whether an export compiles where no call says (`compile=None`, no --compile/--no-compile,
    no --export-compile/--no-export-compile): on, unless DEEPREC_EXPORT_COMPILE=0 (a development loop,
    a test suite, a job whose exports are served elsewhere)."""
    value = os.environ.get(COMPILE_VARIABLE, "").strip().lower() or "1"  # set but empty: the default
    if value not in _SWITCH:
        from deeprec.errors import ConfigError

        raise ConfigError(f"{COMPILE_VARIABLE}={value!r}: expected one of 1, 0, true, false, yes, no, on, off")
    return _SWITCH[value]


@functools.lru_cache(maxsize=1)
def _ops_library() -> str:
    """sha256 of the deeprec C++ extension: a package calls its ops by name, their kernels by schema."""
    import deeprec._C as extension

    with open(extension.__file__, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _describe(value) -> str:
    """A node's value as the compiler sees it: shapes (symbolic ones by name), dtype, strides."""
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{value.dtype}{value.stride()}{value.device.type}"
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(_describe(v) for v in value) + ")"
    return type(value).__name__ + ":" + str(value)


def program_key(program: torch.export.ExportedProgram, device: str, options: dict, flags: list[str]) -> str:
    h = hashlib.sha256()

    def add(*parts) -> None:
        for part in parts:
            h.update(str(part).encode())
            h.update(b"\0")

    add(torch.__version__, sys.version, _ops_library(), sorted(options.items()), device, " ".join(flags),
        sorted((k, v) for k, v in os.environ.items() if k.startswith("TORCHINDUCTOR_") and k not in _WHERE_NOT_WHAT))
    add(program.graph_module.code, program.graph_signature, program.call_spec, program.range_constraints)
    for node in program.graph.nodes:
        add(node.name, _describe(node.meta.get("val")))
    for name, tensor in sorted({**program.state_dict, **program.constants}.items()):
        if isinstance(tensor, torch.Tensor):
            add(name, _describe(tensor))
            if tensor.numel() <= _SMALL:
                add(tensor.detach().cpu().contiguous().numpy().tobytes().hex())
    return h.hexdigest()[:40]


@contextlib.contextmanager
def claimed(key: str):
    """The lock of `key` for the block (blocking while another process holds it). A cache folder that
    cannot be written: no lock (the export compiles, as without a cache)."""
    try:
        os.makedirs(cache_folder(), exist_ok=True)
        fd = os.open(os.path.join(cache_folder(), f"{key}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        fd = None
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a filesystem without flock (some NFS, FUSE): no lock
            os.close(fd)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def fetch(key: str, path: str) -> bool:
    """Copies the package stored under `key` to `path`; False if there is none."""
    stored = os.path.join(cache_folder(), f"{key}.pt2")
    try:
        shutil.copyfile(stored, path)
    except FileNotFoundError:
        return False
    os.utime(stored)  # recently used: kept longer
    return True


def store(key: str, path: str) -> None:
    """Keeps the package at `path` under `key` (atomic: concurrent exports may store the same key);
    the oldest entries beyond MAX_ENTRIES are dropped. A cache that cannot be written is no error."""
    folder = cache_folder()
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{key}.{os.getpid()}.tmp")
        shutil.copyfile(path, tmp)
        os.replace(tmp, os.path.join(folder, f"{key}.pt2"))
        entries = sorted((e for e in os.scandir(folder) if e.name.endswith(".pt2")), key=lambda e: e.stat().st_mtime)
        for old in entries[:-MAX_ENTRIES]:
            os.unlink(old.path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old.path[: -len(".pt2")] + ".lock")
    except OSError:
        pass
