"""A failure keeps the work: a run with --checkpoint-dir that ends on an error saves its last completed
step first; the error then ends the run with its one line, which says where the work is.

    saved on      an error raised between two steps: a checkpoint, an export, an evaluation, the run's
                  tail (the state is a whole step's); a DataError (the reader: the failing batch never
                  reached a step); a NonFiniteError (the failing step was not applied)
    not saved on  an error inside a step (its forward, backward or update may have changed part of
                  the state: a disk tier's StorageFullError, a parameter server or collective failure, a
                  bug in the model), a signal (`Interrupted`: saved already), a collective rank (its
                  ranks save one step together), a PS failure (the save needs the PSs):
                  `Strategy.saves_after`

The step and the reader position saved are the last completed step's, so `--resume` goes on with the
failing batch. A save that fails too (the checkpoint's own disk is full) leaves no part of itself and
the older checkpoints intact; the line says it could not be saved and names the last checkpoint
(a failed checkpoint is not tried again: its line names the last one).

    error: day_1.csv:51: column I1: 'x' is not a number; saved step 812: runs/a/checkpoint-000000812.pt
           (continue with --resume)
"""
from __future__ import annotations

import contextlib
import logging

from rich.markup import escape

from deeprec.errors import CheckpointError, DataError, DeepRecError, NonFiniteError
from deeprec.runtime.signals import Interrupted

log = logging.getLogger("deeprec.train")
OUTSIDE_A_STEP = (DataError, NonFiniteError)  # whatever raises them: the state is the last step's


class KeepWork:
    """The trainer's guard: `with keep.guard():` around the steps, `keep.guard(between_steps=True)` around
    the run's tail; `keep.mark(err)` for an error of the work between two steps."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.between: BaseException | None = None

    def mark(self, err: BaseException) -> BaseException:
        """`err` was raised between two steps (a checkpoint, an export, an evaluation)."""
        self.between = err
        return err

    @contextlib.contextmanager
    def guard(self, between_steps: bool = False):
        try:
            yield
        except Exception as err:
            if between_steps:
                self.mark(err)
            if self._keeps(err):
                self._save_before(err)
            raise

    def _keeps(self, err: Exception) -> bool:
        trainer = self.trainer
        if not trainer.cfg.checkpoint.dir or isinstance(err, Interrupted) or not trainer.strategy.saves_after(err):
            return False
        return err is self.between or isinstance(err, OUTSIDE_A_STEP)

    def _save_before(self, err: Exception) -> None:
        """Save, then say where in the error's own line (a deeprec error), or in a line before it."""
        note, path = self._save(retry=not isinstance(err, CheckpointError))
        err.checkpoint = path
        log.warning("the run failed after step %d: %s", self.trainer.step, note)
        if isinstance(err, DeepRecError) and len(err.args) == 1 and isinstance(err.args[0], str):
            err.args = (f"{err.args[0]}; {note}",)
        else:
            self.trainer.console.print(escape(note), highlight=False)

    def _save(self, retry: bool) -> tuple[str, str | None]:
        """(what was saved, in words; its path or None). `retry`: False when saving is what failed."""
        trainer = self.trainer
        step, last = trainer.step, trainer.last_saved
        if last is not None and last[0] == step:
            return f"step {step} is saved: {last[1]} (continue with --resume)", last[1]
        if step == 0:
            return "no step was done, so there is nothing to save", None
        before = f"the last checkpoint is {last[1]} (step {last[0]}; continue with --resume)" if last else \
            "there is no checkpoint"
        if not retry:
            return before, None
        try:
            path = trainer.save()
        except Exception as err:  # noqa: BLE001 - the error that ended the run is the one raised
            return f"step {step} could not be saved ({err}); {before}", None
        return f"saved step {step}: {path} (continue with --resume)", path


__all__ = ["KeepWork", "OUTSIDE_A_STEP"]
