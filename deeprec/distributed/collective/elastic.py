"""Elastic collective training: a group restarted after a rank failed resumes from its checkpoint.

    torchrun --max-restarts N ...  -m deeprec train --checkpoint-dir CK ...
    deeprec launch --workers 2 --collective --max-restarts N -- train --checkpoint-dir CK ...

A rank killed (SIGKILL, OOM) or failing makes the others fail in their next collective (gloo sees the
connection closed; a silent peer: --collective-timeout). The agent (torchrun's, or deeprec launch)
then stops every rank and starts them all again with TORCHELASTIC_RESTART_COUNT = the restart's
number. A rank started with a count above 0 resumes from --checkpoint-dir as --resume would, even
when the command has no --resume: the newest step every rank saved (step 0 when there is none yet);
without --checkpoint-dir it warns that a restart starts over. Past the last restart the job fails
with the rank's error and the launcher says the restarts are exhausted.
"""
from __future__ import annotations

import os
import signal
import sys

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # torchrun's agent sets both for every rank it starts
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"


def _int_env(name: str, env=None) -> int:
    value = (os.environ if env is None else env).get(name, "") or "0"
    try:
        return int(value)
    except ValueError:
        return 0


def restart_count(env=None) -> int:
    """This rank's restart (0: the first start)."""
    return _int_env(RESTART_ENV, env)


def max_restarts(env=None) -> int:
    return _int_env(MAX_RESTARTS_ENV, env)


def resume_reason(cfg, rank: int) -> str | None:
    """Why this rank resumes from --checkpoint-dir although --resume may not be given: its group was
    restarted (None on a first start). Warns (stderr) when restarts are possible and there is no
    --checkpoint-dir to resume from."""
    count, limit = restart_count(), max_restarts()
    if not cfg.checkpoint.dir:
        if count or limit:
            sys.stderr.write(f"warning: rank {rank}: restarts are on ({MAX_RESTARTS_ENV}={limit}, this is restart "
                             f"{count}) but there is no --checkpoint-dir: a restart starts over from step 0; give "
                             "--checkpoint-dir (and --checkpoint-every) to resume from the last checkpoint\n")
            sys.stderr.flush()
        return None
    return f"restart {count}, {RESTART_ENV}" if count else None


def describe_exit(code: int) -> str:
    """A process's exit code as a person reads it: 1, or -9 (SIGKILL)."""
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


def checkpoint_dir_of(train_args: list[str]) -> str | None:
    """The worker command's --checkpoint-dir (`--checkpoint-dir X` or `--checkpoint-dir=X`)."""
    for i, arg in enumerate(train_args):
        if arg == "--checkpoint-dir" and i + 1 < len(train_args):
            return train_args[i + 1]
        if arg.startswith("--checkpoint-dir="):
            return arg.split("=", 1)[1]
    return None


def newest_step(base: str | None, world: int) -> int | None:
    """The newest step every rank of `world` saved in `base` (what a restart resumes from), or None."""
    if not base:
        return None
    from deeprec.distributed.collective.reshard import _newest_complete

    found = _newest_complete(base, world)
    return found[0][0] if found else None


__all__ = ["RESTART_ENV", "MAX_RESTARTS_ENV", "restart_count", "max_restarts", "resume_reason", "describe_exit",
           "checkpoint_dir_of", "newest_step"]
