"""StarServer's tuning environment variables (shared/seeds/star-server.md), as far as
gRPC in Python can honour them.

    NETWORK_PS_CORE_NUMBER      PS threads that decode/validate/encode requests
                                (default min(8, connections); connections = workers)
    NETWORK_WORKER_CORE_NUMBER  worker threads that encode requests and decode replies
                                (default min(2, connections); connections = PSs)
    PS_DISABLE_PIN_CORES        "False": pin those PS threads
    WORKER_DISABLE_PIN_CORES    "False": pin the worker's communication threads
                                (both default "True": no pinning, as in DeepRec)
    PS_ENABLE_POLLING           accepted and validated; busy polling does not apply:
    WORKER_ENABLE_POLLING       gRPC's completion queues wait on epoll, and Python's
                                gRPC offers no spinning poller (a spinning thread would
                                also take a core from the 2-core training step).

Pinned threads get their own cores: a PS takes `count` cores starting at
`shard_index * count` (wrapping), a worker the last `count` cores it may use, so
the step's intra-op threads keep the first ones.
"""
from __future__ import annotations

import logging
import os

from deeprec.errors import ConfigError

log = logging.getLogger("deeprec.distributed")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"environment variable {name}={raw!r}: use True or False")


def core_number(name: str, connections: int, cap: int) -> int:
    """Threads for communication: the variable if set, else min(cap, connections)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return max(1, min(cap, connections))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"environment variable {name}={raw!r}: must be a positive integer")
    return value


def pin_cores(role: str, count: int, index: int = 0) -> set[int] | None:
    """Cores to pin `role`'s communication threads to, or None (the default: no pinning)."""
    if role not in ("PS", "WORKER"):
        raise ValueError(role)
    if env_flag(f"{role}_ENABLE_POLLING", False):
        log.warning("%s_ENABLE_POLLING=True has no effect: gRPC's completion queues wait on epoll "
                    "and Python's gRPC has no busy-polling mode", role)
    if env_flag(f"{role}_DISABLE_PIN_CORES", True):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    count = min(count, len(allowed))
    if role == "WORKER":
        return set(allowed[-count:])
    start = index * count
    return {allowed[(start + i) % len(allowed)] for i in range(count)}


def pin_current_thread(cores: set[int] | None) -> None:
    """ThreadPoolExecutor initializer: on Linux, pid 0 is the calling thread."""
    if cores:
        os.sched_setaffinity(0, cores)
