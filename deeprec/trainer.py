"""Training loop: read -> forward (preprocessing inside) -> backward -> update,
with progress, periodic atomic checkpoints, exact resume, evaluation and serving exports.

    reader ──batch──> model(batch) ──loss──> backward ──> updater.apply
       │                                                        │
       └── position saved with the updater's state every N steps ─┘

The model is any `nn.Module` that keeps the model contract (deeprec.models.spec); how it
trains (in this process, on parameter servers, collectively) is the `Strategy` handed in
(deeprec.runtime.strategy): this file names no mode.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from dataclasses import asdict

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch.profiler import record_function

from deeprec.checkpoint import remove_stale_temporaries, save_checkpoint
from deeprec.data import resolve_schema, schema_to_dict
from deeprec.data.follow import FollowReader
from deeprec.data.reader import resolve_paths
from deeprec.errors import ConfigError, NonFiniteError
from deeprec.metrics import ranking_columns
from deeprec.models.spec import canonical, is_zoo, load_model, same_model
from deeprec.nn import EmbeddingVariable, incremental_state_dict
from deeprec.nn.tiered import use_storage
from deeprec.progress import get_console as progress_console
from deeprec.runtime import optimize
from deeprec.runtime.device import DeviceBatches, resolve_device
from deeprec.runtime.keep_work import KeepWork
from deeprec.runtime.memory import tune_malloc
from deeprec.runtime.signals import Interrupted, StopOnSignals
from deeprec.runtime.strategy import LocalStrategy, Strategy
from deeprec.readers import make_readers
from deeprec.runlog import RunLog
from deeprec.train_config import TrainConfig

log = logging.getLogger("deeprec.train")
STEADY_AFTER = 50  # steps: warm-up plus SmartStage auto's calibration (deeprec.runtime.auto_stage)


class Trainer:
    """Trains any model that keeps the model contract, the way its `Strategy` says.

        Trainer(cfg)                               the model cfg.model.name names, in this process
        Trainer(cfg, model=MyModel(schema))        your own model object
        Trainer(cfg, strategy=ParameterServer(...) | Collective(...))

        reader ──fast.train_steps(reader, updater)──> (outputs, reader position) per step
                   └ before_step, forward, backward, apply: the strategy's Updater
    """

    def __init__(self, cfg: TrainConfig, console: Console | None = None, *, model: torch.nn.Module | None = None,
                 strategy: Strategy | None = None):
        self.cfg, self.console = cfg, console or progress_console()
        self.strategy = strategy or LocalStrategy()
        self.strategy.validate(cfg)
        if cfg.training.threads:
            torch.set_num_threads(cfg.training.threads)
        torch.manual_seed(cfg.training.seed)
        if cfg.training.flush_denormal:
            torch.set_flush_denormal(True)
        self.malloc_note = tune_malloc() if cfg.training.malloc_tuning else None
        resolve_paths(cfg.data.paths, "--data")  # a missing or unreadable path is named by its flag, first
        if cfg.data.eval_paths:
            resolve_paths(cfg.data.eval_paths, "--eval-data")
        self.schema = resolve_schema(cfg.data.paths, cfg.data.schema)  # the model is built over the data's columns
        self.spec = cfg.model.name if model is None else f"{type(model).__module__}:{type(model).__qualname__}"
        self.model_overrides = self._model_overrides()  # as built, and as checkpoints record it
        self.model = model if model is not None else load_model(cfg.model.name, self.schema, **self.model_overrides)
        if cfg.storage.tiered:  # applied from outside: the model is written plainly
            self._tier_storage()
        self.device = resolve_device(cfg.training.device)
        self.updater = self.strategy.prepare(self.model, cfg, self.device)
        optimize_config = cfg.optimize
        if cfg.data.follow and optimize_config.smart_stage_options.executor == "auto":  # see TrainConfig
            optimize_config = dataclasses.replace(optimize_config, smart_stage_options=dataclasses.replace(
                optimize_config.smart_stage_options, executor="thread"))
        if self.device.type == "cuda":  # the stage runs on CPU into pinned memory, one copy on a side stream
            optimize_config = dataclasses.replace(optimize_config, stage_subgraph_on_cpu=True)
        self.fast = optimize(self.model, optimize_config)
        batch_norm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in self.model.modules())
        self.train_reader, self.eval_reader = make_readers(cfg, self.schema, batch_norm, self.strategy.train_shards(),
                                                           self.strategy.eval_shards())
        self._reader_state = self.train_reader.state_dict()  # position of the last batch trained on
        self._eval_start = self.eval_reader.state_dict() if self.eval_reader is not None else None
        self.skipped_nonfinite = 0
        self.last_saved: tuple[int, str] | None = None  # (step, path) of the newest checkpoint of this run
        self.keep = KeepWork(self)  # an error that ends the run saves the last completed step first
        self.eval_history: list[dict] = []  # --eval-every
        self.exports = None
        if cfg.export.dir and self.strategy.is_chief:
            self.exports = self.strategy.export_writer(cfg.export.dir, self.model, self.schema, canonical(self.spec),
                                                       self.updater, compile=cfg.export.compile)
        if cfg.checkpoint.dir:
            remove_stale_temporaries(self.strategy.checkpoint_dir(cfg.checkpoint.dir))
        if cfg.checkpoint.resume or self.strategy.resume_reason:  # the reason: an elastic restart
            self._restore()
        if cfg.training.steps is not None and self.step > cfg.training.steps:
            raise ConfigError(f"--steps {cfg.training.steps} is below the {self.step} steps already done in "
                              f"{cfg.checkpoint.dir}: give --steps above {self.step} to train on")
        self.runlog = None
        if cfg.training.log_dir:  # after the resume: its step is where the run's events go on
            self.runlog = RunLog(cfg.training.log_dir, self.strategy.run_name, cfg.training.log_every, self.step,
                                 warn=self._warn)
            self.runlog.config(cfg)

    def _model_overrides(self) -> dict:
        overrides = dict(self.cfg.model.overrides)
        if is_zoo(self.spec):
            overrides.update(self.strategy.model_overrides(self.cfg))
            if self.cfg.model.embedding is not None:
                overrides["embedding"] = self.cfg.model.embedding
        elif self.cfg.model.embedding is not None:
            raise ConfigError(f"--embedding chooses a zoo model's tables; {self.spec!r} declares its own "
                              "embeddings (drop --embedding)")
        return overrides

    def _tier_storage(self) -> None:
        variables = sum(isinstance(m, EmbeddingVariable) for m in self.model.modules())
        if not variables:
            raise ConfigError("--storage ssd tiers EmbeddingVariables and this model has none (zoo models: "
                              "--embedding variable)")
        storage = self.cfg.storage  # --dram-bytes is the model's: shared evenly by its EmbeddingVariables
        use_storage(self.model, dataclasses.replace(storage, dram_bytes=max(1, storage.dram_bytes // variables)))

    @property
    def step(self) -> int:
        return self.updater.step

    # -- checkpoints ---------------------------------------------------------------
    def state(self) -> dict:
        return {"model_name": canonical(self.spec), "model_overrides": self.model_overrides, "step": self.step,
                "schema": schema_to_dict(self.schema), "reader": self._reader_state,
                "torch_rng": torch.get_rng_state(), **self.updater.state_dict()}

    def save(self, incremental: bool = False) -> str:
        directory = self.strategy.checkpoint_dir(self.cfg.checkpoint.dir)
        if incremental:
            with incremental_state_dict():
                path = save_checkpoint(directory, self.step, self.state(), kind="incremental")
        else:
            path = save_checkpoint(directory, self.step, self.state())
        self.last_saved = (self.step, path)
        return path

    def _restore(self) -> None:
        found = self.strategy.restore(self.cfg.checkpoint.dir, self.train_reader)
        for err in found.skipped:
            self.console.print(f"[yellow]warning:[/yellow] skipped {escape(str(err))}", highlight=False)
            log.warning("resume skipped %s", err)
        if not found.states:
            self.console.print(f"no checkpoint in {self.cfg.checkpoint.dir}: starting from step 0{self._why()}")
            return
        if found.note:
            self.console.print(found.note)
        for path, state in found.states:
            if not same_model(state["model_name"], self.spec):
                raise ConfigError(f"{path} holds a {state['model_name']!r} model, not {self.spec!r}")
            self.updater.load_state_dict(state)
        self.go_on_from(found.reader, state)
        self.last_saved = (self.step, found.states[-1][0])
        self.console.print(f"resumed from {', '.join(os.path.basename(p) for p, _ in found.states)} at step {self.step}"
                           f"{self._why()}")

    def go_on_from(self, reader: dict, state: dict) -> None:
        """Train on from a checkpoint's place: its reader position, RNG and step (a resume, a rollback)."""
        self.train_reader.load_state_dict(reader)
        self._reader_state = reader
        torch.set_rng_state(state["torch_rng"])
        self.updater.step = int(state["step"])

    def _why(self) -> str:
        return f" ({self.strategy.resume_reason})" if self.strategy.resume_reason else ""

    # -- evaluation, exports --------------------------------------------------------------
    def _evaluate(self) -> dict:
        """One pass over the evaluation data from its start, in bounded memory."""
        self.updater.prepare_eval()
        self.eval_reader.load_state_dict(self._eval_start)
        return self.strategy.evaluate(self.model, self._on_device(self.eval_reader, staged=False),
                                      **ranking_columns(self.schema))

    def _on_device(self, reader, staged: bool | None = None):
        """The reader's batches on the training device: SmartStage's stage copies what it cuts
        (pinned, side stream); a batch that skips the stage is pinned and copied whole."""
        staged = self.fast.staged if staged is None else staged
        return reader if self.device.type == "cpu" or staged else DeviceBatches(reader, self.device)

    def _evaluate_now(self, progress) -> None:
        """--eval-every: evaluate during training and keep the result."""
        if not self.strategy.evaluates:
            return
        metrics = self._evaluate()
        self.eval_history.append({"step": self.step, **metrics})
        if self.runlog is not None:
            self.runlog.evaluation(self.step, metrics)
        progress.console.print(f"step {self.step} eval auc {metrics['auc']:.4f} logloss {metrics['logloss']:.4f} "
                               f"({metrics['rows']} rows)")

    def _export_now(self, final: bool = False) -> None:
        """--export-dir: a full export every --export-every steps, a delta every --export-incremental-every."""
        cfg, step = self.cfg, self.step
        if step == self.exports.last_step:
            return
        if cfg.export.every and step % cfg.export.every == 0:
            self.exports.full(step)
        elif (cfg.export.incremental_every and step % cfg.export.incremental_every == 0) or final:
            self.exports.delta(step)

    def _nonfinite(self, what: str, position: dict | None) -> None:
        """A step that was not applied (its loss or dense gradient is inf or nan); `position`: the reader's after
        its batch."""
        where = f"epoch {position['epoch']}, batch {position['batches']}" if position else "unknown position"
        if self.cfg.training.on_nan == "raise":
            raise NonFiniteError(f"non-finite {what} at step {self.step + 1} (reader {where}; the step was not "
                                 "applied): check the data and the learning rate, or --on-nan skip to skip such "
                                 "batches and count them")
        self.skipped_nonfinite += 1
        log.warning("skipped a batch with a non-finite %s at step %d (reader %s)", what, self.step, where)

    def _after_step(self, progress) -> None:
        """Checkpoints, exports and evaluations that fall on this step."""
        cfg, step = self.cfg, self.step
        if cfg.checkpoint.dir and cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
            self.save()
        elif cfg.checkpoint.dir and cfg.checkpoint.incremental_every and step % cfg.checkpoint.incremental_every == 0:
            self.save(incremental=True)
        if self.exports is not None:
            self._export_now()
        if cfg.training.eval_every and step % cfg.training.eval_every == 0 and self.eval_reader is not None:
            self._evaluate_now(progress)

    def _progress(self) -> Progress:
        return Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                        TextColumn("loss {task.fields[loss]:.4f}  {task.fields[rate]:,.0f} samples/s"),
                        TimeElapsedColumn(), console=self.console,
                        disable=not (self.cfg.training.progress and self.console.is_terminal))

    # -- the loop ------------------------------------------------------------------------
    def train(self) -> dict:
        """Train to cfg.training.steps (or cfg.training.epochs); on SIGINT/SIGTERM finish the step, checkpoint and raise
        `Interrupted`; an error that ends the run saves the last completed step first (deeprec.runtime.keep_work).
        Returns throughput, final loss and evaluation metrics."""
        cfg, total = self.cfg, self.cfg.training.steps
        self.model.train()
        start_step, rows, losses, steady = self.step, 0, [], None
        progress, stop = self._progress(), StopOnSignals()
        if isinstance(self.train_reader, FollowReader):  # its wait for new files ends on a stop request
            self.train_reader.should_stop = lambda: stop.requested
        started = time.perf_counter()
        steps = self._steps()
        with stop, progress, self.keep.guard(), contextlib.closing(steps), self._runlog_closed_on_error():
            task = progress.add_task("train", total=total, completed=self.step, loss=float("nan"), rate=0.0)
            resumed = None  # the first step after a recovery from an error in _after_step
            while resumed is not None or total is None or self.step < total:
                with record_function("deeprec.step"):
                    out, position = resumed or next(steps, (None, self._reader_state))
                resumed = None
                if out is None:
                    break
                if "nonfinite" in out:
                    self._nonfinite(out["nonfinite"], position)  # --on-nan raise: before the position passes it
                    self._reader_state = position
                    continue
                self._reader_state = position  # of the last batch trained on
                if self.step - start_step == STEADY_AFTER:
                    steady = (time.perf_counter(), rows + len(out["logits"]))
                rows += len(out["logits"])
                losses.append(out["loss"].item())
                rate = rows / max(time.perf_counter() - started, 1e-9)
                progress.update(task, completed=self.step, loss=losses[-1], rate=rate)
                if progress.disable and (self.step % self.cfg.training.log_every == 0
                                         or (start_step and self.step == start_step + 1)):
                    self.console.print(f"step {self.step} loss {losses[-1]:.4f} {rate:,.0f} samples/s")
                if self.runlog is not None:
                    self._log_step(losses[-1], len(out["logits"]))
                failed = None
                try:
                    self._after_step(progress)
                except Exception as err:  # noqa: BLE001 - e.g. a PS restart seen by a checkpoint's snapshot
                    failed = self.keep.mark(err)
                if failed is not None:  # recovered outside the handler: the next step's errors are its own
                    resumed = self._recover_in_steps(steps, failed)
                    continue
                if self.strategy.agree(stop.requested):
                    self._stop(stop.signal)
        closing_log = contextlib.closing(self.runlog) if self.runlog is not None else contextlib.nullcontext()
        with stop, closing_log:  # a signal during the tail: it completes, then the run says it was stopped
            self.updater.finish()  # the last step's (a held PS push): an error here is not saved
            with self.keep.guard(between_steps=True):
                if self.exports is not None:
                    self._export_now(final=True)  # the served model catches up with the trained one
                elapsed = time.perf_counter() - started
                saved = self.save() if cfg.checkpoint.dir and self.step > start_step else None
                result = self._result(start_step, rows, losses, steady, started, elapsed, evaluate=not stop.requested)
                evaluated = self.eval_history and self.eval_history[-1]["step"] == self.step
                if self.runlog is not None and "eval" in result and not evaluated:
                    self.runlog.evaluation(self.step, result["eval"])
        if stop.requested:
            raise Interrupted(stop.signal, self.step, saved)
        return result

    def _steps(self):
        """The steps; after an error the strategy recovers from (a PS restart), again from the step it restored."""
        while True:
            try:
                yield from self.fast.train_steps(self._on_device(self.train_reader), self.updater)
                return
            except Exception as err:
                if not self.strategy.recover(self, err):
                    raise
            if self.cfg.training.steps is not None and self.step >= self.cfg.training.steps:
                return  # restored to the last step (its export or evaluation failed): nothing left to train

    def _recover_in_steps(self, steps, err: Exception):
        """An error of a checkpoint, an export or an evaluation between two steps, handed to the steps
        (`_steps`) as if their step had raised it: the stage ahead stops, and the strategy recovers
        (a PS restart: back to the last checkpoint) or the error is raised. Returns the first step
        after the recovery (None: no more steps). Restored to the failed step itself, that step's
        remaining export or evaluation is not redone: the next one covers it."""
        try:
            return steps.throw(err)
        except StopIteration:
            return None

    @contextlib.contextmanager
    def _runlog_closed_on_error(self):
        """--log-dir: a run that fails (NonFiniteError, a DataError) keeps its curve up to the failure
        (the writer's queue is flushed to disk by close)."""
        try:
            yield
        except BaseException:
            if self.runlog is not None:
                self.runlog.close()
            raise

    def _stop(self, signum: int) -> None:
        """A signal asked the run to stop: the step is done; checkpoint it and say where."""
        self.updater.finish()
        path = self.save() if self.cfg.checkpoint.dir else None
        if self.runlog is not None:
            self.runlog.close()
        raise Interrupted(signum, self.step, path)

    def _warn(self, line: str) -> None:
        self.console.print(f"[yellow]warning:[/yellow] {escape(line)}", highlight=False)

    def _log_step(self, loss: float, rows: int) -> None:
        """--log-dir: the step into the window; SmartStage auto's pick once it has measured."""
        self.runlog.step(self.step, loss, rows, self.fast.prefetch_stats,
                         lambda: self.strategy.counters(self.model, self.updater))
        if self.fast.auto_decision is not None:
            self.runlog.text("smart_stage", self.fast.auto_decision.summary(), self.step)

    def _result(self, start_step, rows, losses, steady, started, elapsed, evaluate: bool = True) -> dict:
        result = {"steps": self.step, "steps_this_run": self.step - start_step, "rows": rows,
                  "seconds": elapsed, "samples_per_s": rows / elapsed if elapsed > 0 else 0.0,
                  "final_loss": losses[-1] if losses else math.nan,
                  # after warm-up and SmartStage auto's calibration: the rate a long run keeps
                  "steady_samples_per_s": ((rows - steady[1]) / (started + elapsed - steady[0])
                                           if steady is not None and rows > steady[1] else None),
                  "bad_rows": self.train_reader.stats.bad_rows, "skipped_nonfinite": self.skipped_nonfinite,
                  "model": self.spec, "strategy": self.strategy.name, "rank": self.strategy.rank,
                  "world_size": self.strategy.world_size}
        if self.fast.prefetch_stats is not None:
            result["stage"] = asdict(self.fast.prefetch_stats)
        if self.device.type != "cpu":
            result["device"] = str(self.device)
            result["tables_on_host"] = self.strategy.host_tables
        result.update(self.strategy.summary(self.model, self.updater, result))
        if self.malloc_note:
            result["malloc"] = self.malloc_note
        if self.fast.bf16_note:
            result["bf16"] = ("on: " if self.fast.config.bf16 else "off: ") + self.fast.bf16_note
        if self.fast.auto_decision is not None:
            result["auto"] = self.fast.auto_decision.summary()
            result["auto_executor"] = self.fast.auto_decision.executor
        if self.eval_history:
            result["eval_history"] = self.eval_history
        if self.eval_reader is not None and self.strategy.evaluates and evaluate:
            result["eval"] = self._evaluate()
        return result


def train(cfg: TrainConfig, console: Console | None = None, *, model: torch.nn.Module | None = None,
          strategy: Strategy | None = None) -> dict:
    """Train per `cfg` (any model: `model=` an object, or cfg.model.name a name or module:attribute)."""
    return Trainer(cfg, console, model=model, strategy=strategy).train()


__all__ = ["TrainConfig", "Trainer", "train", "make_readers", "Interrupted"]
