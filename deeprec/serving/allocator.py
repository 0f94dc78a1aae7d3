"""`deeprec serve --allocator`: the C allocator the server process runs with.

A request of a few rows allocates and frees dozens of small tensors (the conversion's, the compiled
package's intermediates); glibc's malloc spends a fifth of a 1-row request's CPU there (malloc, free,
consolidation: perf). mimalloc (the `cmeel-mimalloc` wheel, a dependency) answers the same
requests 5-18% faster on a 2-core Xeon, in process at 1 to 256 rows (docs/serving.md#speed). Training, whose
allocations are few and large, runs slower with it (0.90x, bench/e2e.py's allocator table), so only
the server takes it.

An allocator is chosen before a process starts: `serve` re-executes its command line once with
mimalloc in LD_PRELOAD (`DEEPREC_ALLOCATOR_SET` marks the second start; --workers' processes inherit
it). The second start costs the imports once more (1-2 s).
"""
from __future__ import annotations

import glob
import os
import sys
import sysconfig

from deeprec.choices import ALLOCATORS

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


def run_with(allocator: str, argv: list[str], program: list[str] | None = None) -> None:
    """Re-execute `python -m deeprec argv` (or `python PROGRAM... argv`: bench/serving.py, which measures
    what the server runs) with `allocator` preloaded, unless this process already runs with it; never
    twice (a harness around deeprec.cli.main sets LD_PRELOAD and DEEPREC_ALLOCATOR_SET itself to keep its
    process). Returns only when nothing is to be done. "auto": mimalloc where installed, else the
    system's; "mimalloc" where it is not installed, or not loaded after the re-execution: an error."""
    from deeprec.errors import ConfigError

    if allocator not in ALLOCATORS:
        raise ConfigError(f"--allocator {allocator!r}: one of {', '.join(ALLOCATORS)}")
    if allocator == "system" or not sys.platform.startswith("linux"):
        return
    library = mimalloc_library()
    if library is None and allocator == "mimalloc":
        raise ConfigError("--allocator mimalloc: libmimalloc.so is not installed (pip install cmeel-mimalloc)")
    if library is None or loaded() == "mimalloc":
        return
    if os.environ.get(_MARK):  # re-executed, yet not loaded (the loader only warns)
        if allocator == "mimalloc":
            raise ConfigError(f"--allocator mimalloc: {library} did not load (LD_PRELOAD)")
        return
    preload = " ".join(p for p in (library, os.environ.get("LD_PRELOAD", "")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *(program or ["-m", "deeprec"]), *argv],
              {**os.environ, "LD_PRELOAD": preload, _MARK: "1"})
