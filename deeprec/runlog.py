"""`--log-dir`: a run recorded for TensorBoard as it trains (torch.utils.tensorboard event files).

    every --log-every steps   train/loss            mean loss of the window's steps
                              train/samples_per_s   rows trained per second over the window
                              time/step_ms          wall time per step over the window
                              time/stage_ms         SmartStage's stage per batch (inline or on its threads)
                              ps/*, collective/*, tiers/*   what the Strategy counts
                                                    (deeprec.runtime.strategy.Strategy.counters)
    each evaluation           eval/auc, eval/logloss, eval/gauc, eval/recall@K, eval/ndcg@K,
                              eval/<task>/auc and eval/<task>/logloss of multi-task models
    once                      text "config" (the TrainConfig as TOML-like lines), "smart_stage"
                              (SmartStage auto's pick, when it has measured)

One run per process: DIR itself for a local run, DIR/rank-R for a collective rank, DIR/worker-I
for a parameter-server worker, so TensorBoard shows a job's processes as runs side by side.
A resumed run purges the events past its checkpoint's step (they belong to steps done again).

A write that fails during the run (a full disk: OSError, in tensorboard's writer thread or here)
never ends it: one warning line names the folder and the OS error, logging turns off, training goes
on (docs/reliability.md, "A failure keeps the work"). A folder that cannot be written at the start
is a ConfigError naming --log-dir.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import threading
import time

from deeprec.errors import ConfigError, without_password

log = logging.getLogger("deeprec.runlog")

UNPLOTTED = ("tasks", "rows", "auc_error_bound", "gauc_rows", "retrieval_candidates")  # sizes, not quality


def _flat(prefix: str, values: dict) -> dict[str, float]:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flat(f"{prefix}/{key}", value))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}/{key}"] = float(value)
    return out


def _quiet_writer_thread(hook):
    """threading.excepthook that leaves out tensorboard's event writer thread dying of an OSError (a
    full disk): the writer raises it again in the main thread, where RunLog reports it in one line."""
    def quiet(args):
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError):
            return
        hook(args)
    quiet.deeprec_quiet = True
    return quiet


def _writes(method):
    """A RunLog method that writes: after a failed write it does nothing; an OSError turns logging off."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        if self.failed is None:
            try:
                method(self, *args, **kwargs)
            except OSError as err:
                self._fail(err)
    return guarded


class RunLog:
    """TensorBoard scalars of a training run, written every `every` steps and at each evaluation.
    `warn(line)`: how a failed write is reported, once (default: the log)."""

    def __init__(self, log_dir: str, run: str | None, every: int, start_step: int = 0, warn=None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # tensorboard is a dependency; a broken install is named
            raise ConfigError(f"--log-dir needs the tensorboard package ({err}): pip install tensorboard") from None
        self.path = os.path.join(log_dir, run) if run else log_dir
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"--log-dir {log_dir}: cannot create {self.path}: {err.strerror}") from None
        if not getattr(threading.excepthook, "deeprec_quiet", False):
            threading.excepthook = _quiet_writer_thread(threading.excepthook)
        self.warn = warn or log.warning
        self.failed: OSError | None = None
        try:
            self.writer = SummaryWriter(self.path, purge_step=start_step + 1 if start_step else None)  # past the resume
        except OSError as err:
            raise ConfigError(f"--log-dir {log_dir}: cannot write TensorBoard events in {self.path}: "
                              f"{err.strerror or err}") from None
        self.every = every
        self.stage = None  # the PrefetchStats counted from (a new run of the loop brings a new one, from 0)
        self._window(start_step, stage_seconds=0.0, staged=0)
        self.noted: set[str] = set()

    def _fail(self, err: OSError) -> None:
        """Warn once, naming the folder and the OS error; no more writes (training goes on)."""
        self.failed = err
        self.warn(f"--log-dir {self.path}: cannot write TensorBoard events ({err.strerror or err}): logging is off "
                  "for the rest of the run; training goes on")
        try:
            self.writer.close()  # its thread has stopped; what it still holds cannot be written
        except OSError:
            pass

    def _window(self, step: int, stage_seconds: float, staged: int) -> None:
        self.window_start, self.window_step = time.perf_counter(), step
        self.loss_sum, self.losses, self.rows = 0.0, 0, 0
        self.stage_seconds, self.staged = stage_seconds, staged

    @_writes
    def text(self, tag: str, body: str, step: int = 0) -> None:
        """Written once per tag (the config, SmartStage's pick)."""
        if tag not in self.noted:
            self.noted.add(tag)
            self.writer.add_text(tag, body, step)

    def config(self, cfg) -> None:
        lines = [f"    [{f.name}] " + ", ".join(f"{k} = {v!r}" for k, v in dataclasses.asdict(getattr(cfg, f.name)).items())
                 for f in dataclasses.fields(cfg)]
        self.text("config", without_password("\n".join(lines)))  # indented: TensorBoard renders it as code, one section a line

    @_writes
    def step(self, step: int, loss: float, rows: int, stage=None, counters=None) -> None:
        """After each step; every `every` steps writes the window's scalars. `stage`: SmartStage's
        PrefetchStats (cumulative); `counters()`: the Strategy's, called only when writing."""
        if math.isfinite(loss):
            self.loss_sum, self.losses = self.loss_sum + loss, self.losses + 1
        self.rows += rows
        if step % self.every:
            return
        now = time.perf_counter()
        steps, seconds = step - self.window_step, now - self.window_start
        scalars = {}
        if self.losses:
            scalars["train/loss"] = self.loss_sum / self.losses
        if steps > 0 and seconds > 0:
            scalars["train/samples_per_s"] = self.rows / seconds
            scalars["time/step_ms"] = 1e3 * seconds / steps
        stage_seconds, staged = (stage.stage_seconds, stage.prefetched) if stage is not None else (0.0, 0)
        if stage is not self.stage:  # counts restarted (the loop resumed after a PS recovery, say): from 0
            self.stage, self.stage_seconds, self.staged = stage, 0.0, 0
        if staged > self.staged:
            scalars["time/stage_ms"] = 1e3 * (stage_seconds - self.stage_seconds) / (staged - self.staged)
        if counters is not None:
            scalars.update(counters())
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self._window(step, stage_seconds, staged)

    @_writes
    def evaluation(self, step: int, metrics: dict) -> None:
        tasks = {task: {k: v for k, v in values.items() if k not in UNPLOTTED}
                 for task, values in (metrics.get("tasks") or {}).items()}
        top = {k: v for k, v in metrics.items() if k not in UNPLOTTED}
        for tag, value in {**_flat("eval", top), **_flat("eval", tasks)}.items():
            if math.isfinite(value):
                self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    @_writes
    def close(self) -> None:
        self.writer.flush()  # raises what the writer thread met, if it met anything
        self.writer.close()


__all__ = ["RunLog"]
