"""Training loop: read -> forward (preprocessing inside) -> backward -> update,
with progress, periodic atomic checkpoints, exact resume and evaluation.

    reader ──batch──> model(batch) ──loss──> backward ──> updater.apply
       │                                                        │
       └── position saved with the updater's state every N steps ─┘
"""
from __future__ import annotations

import contextlib
import logging
import os
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from sklearn.metrics import log_loss, roc_auc_score
from torch.profiler import record_function

from deeprec.config import Config, SmartStageOptions
from deeprec.graph.streams import MultiStreamOptions
from deeprec.checkpoint import (checkpoint_step, latest_checkpoint, list_checkpoints, load_checkpoint,
                                save_checkpoint)
from deeprec.data import open_reader, resolve_schema, schema_to_dict
from deeprec.errors import ConfigError
from deeprec.models import build_model
from deeprec.nn import incremental_state_dict
from deeprec.runtime import optimize
from deeprec.runtime.updater import make_updater
from deeprec.runtime.memory import tune_malloc

log = logging.getLogger("deeprec.train")
STEADY_AFTER = 50  # steps: warm-up plus SmartStage auto's calibration (deeprec.runtime.auto_stage)


@dataclass
class TrainConfig:
    model: str = "dlrm"
    data: list[str] = field(default_factory=list)
    eval_data: list[str] = field(default_factory=list)
    eval_fraction: float = 0.0  # without eval_data: hold out this share of `data` (whole byte ranges)
    steps: int | None = None  # total optimizer steps (resume counts the steps already done)
    epochs: int | None = None  # used when steps is None; default 1
    batch_size: int = 512
    eval_batch_size: int = 4096
    lr: float = 0.001
    optimizer: str = "adam"  # DeepRec modelzoo default
    shuffle_buffer: int = 0
    seed: int = 0
    on_bad_row: str = "raise"
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # steps between checkpoints; 0 = only at the end
    incremental_every: int = 0  # steps between incremental checkpoints (EmbeddingVariable rows touched since)
    resume: bool = False
    threads: int | None = None
    model_overrides: dict = field(default_factory=dict)
    schema: str | None = None  # preset name or TOML file (None: the preset the data matches)
    progress: bool = True
    smart_stage: bool = False  # pipeline the data-side subgraph (deeprec.optimize)
    capacity: int = 1  # SmartStageOptions.capacity
    stage_threads: int = 1  # SmartStageOptions.num_threads
    stage_executor: str = "auto"  # SmartStageOptions.executor: "auto" | "thread" | "process"
    main_threads: int | None = None  # intra-op threads of the step while staging (None: cores - stage)
    embedding: str | None = None  # table | variable | torch (None: the model's default)
    flush_denormal: bool = True  # tiny embedding weights turn denormal and slow CPU math ~2x
    ps_addresses: list = field(default_factory=list)  # parameter servers: train as a PS worker
    protocol: str = "star_server"  # grpc | star_server | star_server_lite
    shard_index: int = 0  # this worker's share of the training data
    num_shards: int = 1
    is_chief: bool = True  # evaluates at the end
    sync: bool = False  # PS training: average every worker's gradients per step (num_shards workers)
    async_embedding: bool = False  # PS training + SmartStage: pull batch t+1's rows while batch t computes
    multi_stream: int = 1  # MultiStreamOptions.num_streams (1: off)
    stream_policy: str = "embedding"  # MultiStreamOptions.policy
    micro_batch: int = 1  # Config.micro_batch_num
    compile: bool = False  # Config.graph_fusion (torch.compile of the step)
    bf16: bool | str = False  # Config.bf16: True, False or "auto" (autocast bfloat16, fp32 weights)
    malloc_tuning: bool = False  # glibc mallopt: keep freed memory mapped (deeprec.runtime.memory)

    def __post_init__(self):
        if isinstance(self.data, str):
            self.data = [self.data]
        if isinstance(self.eval_data, str):
            self.eval_data = [self.eval_data]
        if not self.data:
            raise ConfigError("no training data: give data=[paths]")
        if self.steps is not None and self.epochs is not None:
            raise ConfigError("give steps or epochs, not both")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("resume needs checkpoint_dir")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.ps_addresses and self.incremental_every:
            raise ConfigError("incremental checkpoints of parameter-server training are not implemented yet")
        if self.ps_addresses and self.embedding not in (None, "variable"):
            raise ConfigError("parameter-server training keeps embeddings as EmbeddingVariables: "
                              f"embedding={self.embedding!r} is not supported there")
        if self.async_embedding and not (self.ps_addresses and self.smart_stage):
            raise ConfigError("async_embedding pulls embedding rows from the parameter servers in the "
                              "SmartStage prefetch: it needs ps_addresses and smart_stage=True")
        if self.async_embedding and self.sync:
            raise ConfigError("sync training reads each step's rows after the previous update; async_embedding "
                              "reads them earlier: choose one")
        if self.num_shards > 1 and self.eval_fraction:
            raise ConfigError("a sharded worker cannot also hold out eval_fraction: give eval_data")


def _holdout_shards(fraction: float) -> tuple[int, list[int], int]:
    """Split data into n byte-range shards: train on all but the last, evaluate on the last."""
    n = max(2, round(1.0 / fraction))
    return n, list(range(n - 1)), n - 1


def make_readers(cfg: TrainConfig, schema=None, drop_remainder: bool = False):
    """drop_remainder: training drops an epoch's short last batch (batch norm cannot train on one row)."""
    common = dict(seed=cfg.seed, on_bad_row=cfg.on_bad_row, schema=schema)
    epochs = None if cfg.steps is not None else (cfg.epochs or 1)
    train_kw = dict(shuffle_buffer=cfg.shuffle_buffer, num_epochs=epochs, drop_remainder=drop_remainder, **common)
    if cfg.num_shards > 1:  # a PS worker reads its share
        train_kw.update(shard_index=cfg.shard_index, num_shards=cfg.num_shards)
    eval_kw = dict(num_epochs=1, **common)
    if cfg.eval_data:
        return open_reader(cfg.data, cfg.batch_size, **train_kw), open_reader(cfg.eval_data, cfg.eval_batch_size, **eval_kw)
    if cfg.eval_fraction:
        n, train_shards, eval_shard = _holdout_shards(cfg.eval_fraction)
        return (open_reader(cfg.data, cfg.batch_size, num_shards=n, shard_index=train_shards, **train_kw),
                open_reader(cfg.data, cfg.eval_batch_size, num_shards=n, shard_index=eval_shard, **eval_kw))
    return open_reader(cfg.data, cfg.batch_size, **train_kw), None


def _metrics(y: np.ndarray, logits: np.ndarray) -> dict:
    p = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    auc = roc_auc_score(y, p) if 0 < y.sum() < len(y) else float("nan")  # undefined for one class
    return {"auc": float(auc), "logloss": float(log_loss(y, p, labels=[0, 1]))}


@torch.no_grad()
def evaluate(model: torch.nn.Module, reader) -> dict:
    """AUC and log loss (scikit-learn) of the model's predictions over one pass;
    a multi-task model (logits [B, T]) gets them per task under "tasks", the first
    task's at the top level."""
    names = tuple(getattr(model, "label_columns", ("label",)))
    was_training = model.training
    model.eval()
    labels, logits = [], []
    try:
        for batch in reader:
            labels.append(np.stack([batch[n].numpy() for n in names], axis=1))
            out = model(batch)["logits"].float()
            logits.append((out if out.dim() == 2 else out.unsqueeze(1)).numpy())
    finally:
        model.train(was_training)
    if not labels:
        return {"rows": 0, "auc": float("nan"), "logloss": float("nan")}
    y, z = np.concatenate(labels), np.concatenate(logits)
    tasks = {name: _metrics(y[:, k], z[:, k]) for k, name in enumerate(names)}
    result = {"rows": int(len(y)), **tasks[names[0]]}
    if len(names) > 1:
        result["tasks"] = tasks
    return result


class Trainer:
    """Builds the model over the data's schema, its updater (local or parameter servers),
    and `deeprec.optimize`'s passes; `train()` runs the loop.

        reader ──fast.train_steps(reader, updater)──> (outputs, reader position) per step
                   └ before_step, forward, backward, apply: deeprec.runtime.updater
    """

    def __init__(self, cfg: TrainConfig, console: Console | None = None):
        self.cfg = cfg
        self.console = console or Console(stderr=True)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        if cfg.flush_denormal:
            torch.set_flush_denormal(True)
        self.malloc_note = tune_malloc() if cfg.malloc_tuning else None
        self.model_overrides = dict(cfg.model_overrides)  # as built, and as checkpoints record it
        if cfg.embedding is not None or cfg.ps_addresses:
            self.model_overrides["embedding"] = cfg.embedding or "variable"
        self.schema = resolve_schema(cfg.data, cfg.schema)  # the model is built over the data's columns
        self.model = build_model(cfg.model, schema=self.schema, **self.model_overrides)
        self.updater = make_updater(self.model, cfg.optimizer, cfg.lr, cfg.ps_addresses, cfg.protocol,
                                    sync_workers=cfg.num_shards if cfg.sync else 1, worker_index=cfg.shard_index)
        self.fast = optimize(self.model, Config(
            smart_stage=cfg.smart_stage, main_threads=cfg.main_threads, async_embedding=cfg.async_embedding,
            smart_stage_options=SmartStageOptions(capacity=cfg.capacity, num_threads=cfg.stage_threads,
                                                  executor=cfg.stage_executor),
            multi_stream=MultiStreamOptions(cfg.multi_stream, cfg.stream_policy) if cfg.multi_stream > 1 else None,
            micro_batch_num=cfg.micro_batch, graph_fusion=cfg.compile, bf16=cfg.bf16))
        batch_norm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in self.model.modules())
        self.train_reader, self.eval_reader = make_readers(cfg, self.schema, drop_remainder=batch_norm)
        self._reader_state = self.train_reader.state_dict()  # position of the last batch trained on
        if cfg.resume:
            self._restore()

    @property
    def step(self) -> int:
        return self.updater.step

    # -- checkpoints ---------------------------------------------------------------
    def state(self) -> dict:
        return {"model_name": self.cfg.model, "model_overrides": self.model_overrides, "step": self.step,
                "schema": schema_to_dict(self.schema), "reader": self._reader_state,
                "torch_rng": torch.get_rng_state(), **self.updater.state_dict()}

    def save(self, incremental: bool = False) -> str:
        if incremental:
            with incremental_state_dict():
                return save_checkpoint(self.cfg.checkpoint_dir, self.step, self.state(), kind="incremental")
        return save_checkpoint(self.updater.checkpoint_dir(self.cfg.checkpoint_dir), self.step, self.state())

    def _restore(self) -> None:
        """The latest full checkpoint, then the incremental ones after it, in order."""
        directory = self.updater.checkpoint_dir(self.cfg.checkpoint_dir)
        full = latest_checkpoint(directory)
        base = checkpoint_step(full) if full else -1
        chain = ([full] if full else []) + [p for p in list_checkpoints(directory, "incremental")
                                             if checkpoint_step(p) > base]
        if not chain:
            self.console.print(f"no checkpoint in {directory}: starting from step 0")
            return
        for path in chain:
            state = load_checkpoint(path)
            if state["model_name"] != self.cfg.model:
                raise ConfigError(f"{path} holds a {state['model_name']!r} model, not {self.cfg.model!r}")
            self.updater.load_state_dict(state)
        self.train_reader.load_state_dict(state["reader"])
        self._reader_state = state["reader"]
        torch.set_rng_state(state["torch_rng"])
        self.updater.step = int(state["step"])
        self.console.print(f"resumed from {', '.join(map(os.path.basename, chain))} at step {self.step}")

    # -- loop ------------------------------------------------------------------------
    def train(self) -> dict:
        cfg = self.cfg
        self.model.train()
        start_step, rows, losses, steady = self.step, 0, [], None
        total = cfg.steps
        progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                            TextColumn("loss {task.fields[loss]:.4f}  {task.fields[rate]:,.0f} samples/s"),
                            TimeElapsedColumn(), console=self.console,
                            disable=not (cfg.progress and self.console.is_terminal))
        started = time.perf_counter()
        steps = self.fast.train_steps(self.train_reader, self.updater)
        with progress, contextlib.closing(steps):
            task = progress.add_task("train", total=total, completed=self.step, loss=float("nan"), rate=0.0)
            while total is None or self.step < total:
                with record_function("deeprec.step"):
                    out, self._reader_state = next(steps, (None, self._reader_state))
                if out is None:
                    break
                if self.step - start_step == STEADY_AFTER:
                    steady = (time.perf_counter(), rows + len(out["logits"]))
                rows += len(out["logits"])
                losses.append(out["loss"].item())
                rate = rows / max(time.perf_counter() - started, 1e-9)
                progress.update(task, completed=self.step, loss=losses[-1], rate=rate)
                if progress.disable and (self.step % 100 == 0):
                    self.console.print(f"step {self.step} loss {losses[-1]:.4f} {rate:,.0f} samples/s")
                if cfg.checkpoint_dir and cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    self.save()
                elif cfg.checkpoint_dir and cfg.incremental_every and self.step % cfg.incremental_every == 0:
                    self.save(incremental=True)
        self.updater.finish()
        elapsed = time.perf_counter() - started
        if cfg.checkpoint_dir and self.step > start_step:
            self.save()
        result = {"steps": self.step, "steps_this_run": self.step - start_step, "rows": rows,
                  "seconds": elapsed, "samples_per_s": rows / elapsed if elapsed > 0 else 0.0,
                  "final_loss": losses[-1] if losses else math.nan,
                  # after warm-up and SmartStage auto's calibration: the rate a long run keeps
                  "steady_samples_per_s": ((rows - steady[1]) / (started + elapsed - steady[0])
                                           if steady is not None and rows > steady[1] else None),
                  "bad_rows": self.train_reader.stats.bad_rows}
        if self.fast.prefetch_stats is not None:
            result["stage"] = asdict(self.fast.prefetch_stats)
        if self.malloc_note:
            result["malloc"] = self.malloc_note
        if self.fast.bf16_note:
            result["bf16"] = ("on: " if self.fast.config.bf16 else "off: ") + self.fast.bf16_note
        if self.fast.auto_decision is not None:
            result["auto"] = self.fast.auto_decision.summary()
            result["auto_executor"] = self.fast.auto_decision.executor
        if self.eval_reader is not None and cfg.is_chief:
            self.updater.prepare_eval()
            result["eval"] = evaluate(self.model, self.eval_reader)
        return result


def train(cfg: TrainConfig, console: Console | None = None) -> dict:
    """Train per `cfg`; returns throughput, final loss and eval metrics."""
    return Trainer(cfg, console).train()


__all__ = ["TrainConfig", "Trainer", "train", "evaluate", "asdict"]
