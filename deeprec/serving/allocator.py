"""`deeprec serve --allocator`: the C allocator the server process runs with.

A request of a few rows allocates and frees dozens of small tensors (the conversion's, the compiled
package's intermediates); glibc's malloc spends a fifth of a 1-row request's CPU there (malloc, free,
consolidation: perf). mimalloc (the `cmeel-mimalloc` wheel, a dependency) answers the same
requests 5-18% faster on this 2-core Xeon, at 1 to 256 rows (docs/benchmarks.md). Training, whose
allocations are few and large, runs slower with it (0.90x, bench/e2e.py's allocator table), so only
the server takes it.

An allocator is chosen before a process starts: `serve` re-executes itself once with mimalloc in
LD_PRELOAD (`DEEPREC_ALLOCATOR_SET` marks the second start; --workers' processes inherit it).
"""
from __future__ import annotations

import glob
import os
import sys
import sysconfig

ALLOCATORS = ("auto", "mimalloc", "system")
_MARK = "DEEPREC_ALLOCATOR_SET"


def mimalloc_library() -> str | None:
    """libmimalloc.so of the `cmeel-mimalloc` wheel, if installed."""
    found = glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "cmeel.prefix", "lib", "libmimalloc.so"))
    return found[0] if found else None


def loaded() -> str:
    """The allocator this process runs with: "mimalloc" when its library is mapped, else "system"."""
    try:
        with open("/proc/self/maps") as f:
            return "mimalloc" if "libmimalloc" in f.read() else "system"
    except OSError:
        return "system"


def run_with(allocator: str, argv: list[str]) -> None:
    """Re-execute `python -m deeprec argv` with `allocator` preloaded, unless this process already runs
    with it (or was already re-executed: never twice). Returns only when nothing is to be done.
    "auto": mimalloc where installed, else the system's; "mimalloc" where it is not installed: an error."""
    from deeprec.errors import ConfigError

    if allocator not in ALLOCATORS:
        raise ConfigError(f"--allocator {allocator!r}: one of {', '.join(ALLOCATORS)}")
    if allocator == "system" or os.environ.get(_MARK) or not sys.platform.startswith("linux"):
        return
    library = mimalloc_library()
    if library is None:
        if allocator == "mimalloc":
            raise ConfigError("--allocator mimalloc: libmimalloc.so is not installed (pip install cmeel-mimalloc)")
        return
    if loaded() == "mimalloc":
        return
    preload = " ".join(p for p in (library, os.environ.get("LD_PRELOAD", "")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "deeprec", *argv],
              {**os.environ, "LD_PRELOAD": preload, _MARK: "1"})
