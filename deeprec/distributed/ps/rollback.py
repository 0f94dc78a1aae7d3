"""A PS restarted mid-run: the workers, still running, go back to the job's last checkpoint.

    a PS answers "restarted" / "rolled back" (PSRolledBack: its incarnation or restore differs from
    the one the worker registered with)
      chief:      re-register on every PS (the restarted one has no variables), restore every PS
                  from the newest checkpoint (the rows of every shard, the survivors' too, go back)
      the others: wait until every PS has taken that restore, load their own checkpoint of its step
      all:        reader position, RNG and step from that checkpoint; training goes on from there

The model is then one the job passed through: the result equals an uninterrupted job resumed
(--resume) from the same checkpoint. Without --checkpoint-dir there is nothing to go back to: a
clear error. Rollbacks with no step done in between are bounded (MAX_ROLLBACKS).
"""
from __future__ import annotations

import logging
import os

from deeprec.checkpoint import checkpoint_step, list_checkpoints, load_checkpoint
from deeprec.distributed.ps.client import PSError, PSRolledBack, out_of_step

log = logging.getLogger("deeprec.ps")
MAX_ROLLBACKS = 3  # in a row, to the same checkpoint with no step past it in between


def roll_back(trainer, strategy, err: BaseException) -> bool:
    """Roll `trainer` back after `err` if it is a PS restart; False for any other error."""
    if not isinstance(err, PSRolledBack):
        return False
    cfg, updater = trainer.cfg, trainer.updater
    client, failed_at = updater.client, updater.step
    if not cfg.checkpoint.dir:
        raise PSError(f"{err}; there is no checkpoint to roll back to: train with --checkpoint-dir and "
                      "--checkpoint-every so that the workers go on from the last checkpoint") from None
    if updater.allreduce is not None:
        raise PSError(f"{err}; with --dense allreduce and several workers the workers cannot roll back in "
                      "place: restart the job with --resume (or train with --dense ps)") from None
    last = getattr(strategy, "_rollback", None)  # (restored step, rollbacks to it with no step past it)
    updater.reset()
    if updater.is_chief:
        updater.reregister()
        found = strategy.restore(cfg.checkpoint.dir, trainer.train_reader)
        if not found.states:
            raise PSError(f"{err}; no checkpoint in {cfg.checkpoint.dir} yet to roll back to") from None
        path, state = found.states[-1]
        if len(found.states) > 1:
            raise PSError(f"{err}; {path} is an incremental checkpoint: PS jobs roll back to full ones") from None
    else:
        step = client.wait_restored(client.deadline_s)
        path, state = _own_checkpoint(strategy.checkpoint_dir(cfg.checkpoint.dir), step, err,
                                      exact=client.sync_workers > 1)
    step = int(state["step"])
    count = last[1] + 1 if last is not None and last[0] == step and failed_at <= step else 1
    if count > MAX_ROLLBACKS:
        raise PSError(f"{err}; rolled back to step {step} {MAX_ROLLBACKS} times in a row without getting "
                      "past it: giving up") from None
    strategy._rollback = (step, count)
    updater.load_state_dict(state, wait=False)  # the chief restores every PS here
    trainer.go_on_from(state["reader"], state)
    redone = f"steps {step + 1}-{failed_at} redone" if failed_at > step else "no step redone"
    message = f"{err}: rolled back to the checkpoint of step {step} ({redone}; {os.path.basename(path)})"
    log.warning("%s", message)
    return True


def _own_checkpoint(directory: str, step: int | None, err, exact: bool) -> tuple[str, dict]:
    """A non-chief worker's checkpoint at the chief's step; async workers, whose steps are their own,
    take their newest at or before it. Sync workers all save each checkpoint step: a missing one (its
    save cut by the restart) is an error, since another step would leave this worker out of step."""
    paths = [p for p in list_checkpoints(directory) if step is None or checkpoint_step(p) <= step]
    if exact and step is not None and (not paths or checkpoint_step(paths[-1]) != step):
        own = checkpoint_step(paths[-1]) if paths else None
        raise PSError(f"{err}; {out_of_step(step, own)} ({directory})") from None
    if not paths:
        raise PSError(f"{err}; the chief restored the PSs to step {step} but {directory} holds no checkpoint of "
                      "this worker at or before it") from None
    return paths[-1], load_checkpoint(paths[-1])
