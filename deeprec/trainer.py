"""Training loop: read -> forward (preprocessing inside) -> backward -> update,
with progress, periodic atomic checkpoints, exact resume and evaluation.

    reader ──batch──> model(batch) ──loss──> backward ──> updater.apply
       │                                                        │
       └── position saved with the updater's state every N steps ─┘
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import math
import time
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch.profiler import record_function

from deeprec.config import Config, SmartStageOptions
from deeprec.distributed.client import DENSE_MODES, PROTOCOLS
from deeprec.models.features import EMBEDDINGS
from deeprec.optim import OPTIMIZERS
from deeprec.options import build, option
from rich.markup import escape

from deeprec.checkpoint import (checkpoint_step, list_checkpoints, load_checkpoint, remove_stale_temporaries,
                                save_checkpoint)
from deeprec.data import open_reader, resolve_schema, schema_to_dict
from deeprec.errors import CheckpointError, ConfigError, NonFiniteError
from deeprec.metrics import evaluate
from deeprec.models import MODELS, build_model
from deeprec.nn import EmbeddingVariable, StorageOption, incremental_state_dict
from deeprec.nn.tiered import tier_summary, use_storage
from deeprec.runtime import optimize
from deeprec.runtime.device import DEVICES, DeviceBatches, place_model, resolve_device
from deeprec.runtime.updater import make_updater
from deeprec.runtime.memory import tune_malloc

log = logging.getLogger("deeprec.train")
STEADY_AFTER = 50  # steps: warm-up plus SmartStage auto's calibration (deeprec.runtime.auto_stage)


@dataclass
class TrainConfig:
    """Everything `deeprec train` takes: each field is a CLI flag (`deeprec train --help`)
    and a key of a `--config run.toml` file; `optimize` holds deeprec.optimize's options."""

    model: str = option("dlrm", "the model", choices=tuple(sorted(MODELS)))
    data: list[str] = option(factory=list, help="TSV/CSV/Parquet files, folders or globs (default: the model's "
                             "bundled real sample)")
    eval_data: list[str] = option(factory=list, help="evaluation files (default: none, or --eval-fraction)")
    eval_fraction: float = option(0.0, "without eval data: hold out this share of the data (whole byte ranges); "
                                  "0.2 on a bundled sample")
    steps: int | None = option(None, "total optimizer steps (resume counts the steps already done)")
    epochs: int | None = option(None, "passes over the data when --steps is not given (default 1)")
    batch_size: int = option(512, "rows per training batch")
    eval_batch_size: int = option(4096, "rows per evaluation batch")
    eval_every: int = option(0, "steps between evaluations during training (0: only at the end)")
    lr: float = option(0.001, "learning rate")
    optimizer: str = option("adam", "optimizer of every parameter (DeepRec modelzoo default: adam)",
                            choices=OPTIMIZERS)
    shuffle_buffer: int = option(0, "rows shuffled in a buffer of this size (0: file order)")
    seed: int = option(0, "seed of the model's initialization and the shuffle")
    on_bad_row: str = option("raise", "a row that does not parse: stop with its file and line, or skip and count it",
                             choices=("raise", "skip"))
    on_nan: str = option("raise", "a step whose loss or dense gradient is not finite is never applied: stop with "
                         "its step and reader position, or skip that batch and count it", choices=("raise", "skip"))
    checkpoint_dir: str | None = option(None, "folder of the checkpoints")
    checkpoint_every: int = option(0, "steps between checkpoints; 0: only at the end")
    incremental_every: int = option(0, "steps between incremental checkpoints (EmbeddingVariable rows touched "
                                    "since the last full one)")
    resume: bool = option(False, "continue from the latest checkpoint in --checkpoint-dir")
    export_dir: str | None = option(None, "folder of serving exports written while training (deeprec serve follows it)")
    export_every: int = option(0, "steps between full serving exports (with --export-dir; 0: only at the end)")
    export_incremental_every: int = option(0, "steps between serving deltas: EmbeddingVariable rows updated since "
                                           "the last export, and the dense weights")
    threads: int | None = option(None, "torch intra-op threads")
    device: str = option("cpu", "where the model trains: cpu, cuda (fixed tables too while they fit in its memory; "
                         "EmbeddingVariables stay on the host) or auto (cuda if present)", choices=DEVICES)
    model_overrides: dict = option(factory=dict, cli=False)  # TOML table: the model's config fields
    schema: str | None = option(None, "the data's columns: a preset (criteo, avazu, movielens, byterec, behavior) "
                                "or a TOML schema file (default: the preset the data matches)")
    progress: bool = option(True, "show a progress bar on a terminal")
    embedding: str | None = option(None, "fused hashed tables (default), EmbeddingVariables (no buckets), or "
                                   "nn.Embedding", choices=EMBEDDINGS)
    storage: str = option("dram", "where EmbeddingVariable rows live (with --embedding variable): all in DRAM, or "
                          "at most --dram-bytes of them in a DRAM cache over a disk tier in --storage-path",
                          choices=("dram", "ssd"))
    dram_bytes: int | None = option(None, "--storage ssd: bytes of rows (values, optimizer slots) kept in DRAM, "
                                    "shared evenly by the EmbeddingVariables")
    storage_path: str | None = option(None, "--storage ssd: folder of the disk tier (default: the temp folder)")
    cache: str = option("lfu", "--storage ssd: rows that leave DRAM first, least frequently or recently used",
                        choices=("lfu", "lru"))
    storage_prefetch: bool = option(True, "--storage ssd with SmartStage: the stage moves the next batch's rows "
                                    "from disk into DRAM while the current batch trains")
    flush_denormal: bool = option(True, "flush denormal floats (tiny embedding weights slow CPU math ~2x)")
    malloc_tuning: bool = option(False, "glibc mallopt: keep freed memory mapped (halves page faults per step)")
    protocol: str = option("star_server", "parameter-server protocol of a PS worker (TF_CONFIG set)",
                           choices=PROTOCOLS)
    sync: bool = option(False, "PS workers: average every worker's gradients per step")
    dense: str = option("allreduce", "PS workers: dense parameters replicated on the workers and averaged by "
                        "all-reduce (only embedding rows go to the PSs), or kept on the PSs", choices=DENSE_MODES)
    ps_addresses: list[str] = option(factory=list, cli=False, file=False)  # from TF_CONFIG: a PS worker
    shard_index: int = option(0, cli=False, file=False)  # this worker's share of the training data
    num_shards: int = option(1, cli=False, file=False)
    is_chief: bool = option(True, cli=False, file=False)  # evaluates at the end
    collective: bool = option(False, cli=False, file=False)  # a torchrun rank: embeddings sharded by all-to-all
    master: str | None = option(None, cli=False, file=False)  # worker 0's TF_CONFIG address: all-reduce rendezvous
    # deeprec.optimize's options; SmartStage's executor is "auto" here (measure, then pick off, thread or process)
    optimize: Config = option(factory=lambda: Config(smart_stage_options=SmartStageOptions(executor="auto")))

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
        if self.ps_addresses and self.export_dir:
            raise ConfigError("serving exports of parameter-server training are not implemented yet: export a "
                              "checkpoint with deeprec export")
        if self.ps_addresses and self.incremental_every:
            raise ConfigError("incremental checkpoints of parameter-server training are not implemented yet")
        if self.ps_addresses and self.embedding not in (None, "variable"):
            raise ConfigError("parameter-server training keeps embeddings as EmbeddingVariables: "
                              f"embedding={self.embedding!r} is not supported there")
        if self.collective:
            if self.embedding == "torch":
                raise ConfigError("collective training (torchrun) shards EmbeddingCollections: --embedding torch "
                                  "(nn.Embedding) is not sharded; give --embedding table or variable")
            if self.steps is None:
                raise ConfigError("collective training (torchrun) needs --steps: every rank must take the same "
                                  "number of steps (each exchanges ids with the others)")
            if self.incremental_every:
                raise ConfigError("incremental checkpoints of collective training are not implemented yet")
            if self.on_nan == "skip":
                raise ConfigError("on_nan='skip' is not supported with collective training (torchrun): every rank "
                                  "takes every step together; a non-finite step stops every rank (use on_nan='raise')")
            if self.optimize.async_embedding:
                raise ConfigError("async_embedding is not supported with collective training (torchrun): the id "
                                  "exchange is a collective every rank runs in the same order inside the step, not "
                                  "ahead of it in SmartStage; drop --async-embedding (SmartStage and --micro-batch work)")
            if self.export_dir:
                raise ConfigError("serving exports of collective training (torchrun) are not implemented yet: drop "
                                  "--export-dir and export a checkpoint with deeprec export")
        if self.device != "cpu" and self.ps_addresses:
            raise ConfigError("parameter-server training runs on the CPU here: --device cuda/auto is for local and "
                              "collective (torchrun) training")
        if self.storage == "ssd":
            if self.embedding != "variable" or self.ps_addresses:
                raise ConfigError("storage='ssd' tiers EmbeddingVariables of local training: give "
                                  "embedding='variable' (a PS shard tiers its rows itself: python -m "
                                  "deeprec.distributed --storage ssd --dram-bytes N)")
            if not self.dram_bytes or self.dram_bytes <= 0:
                raise ConfigError(f"storage='ssd' needs dram_bytes > 0 (the DRAM cache's budget), got {self.dram_bytes!r}")
        if (self.export_every or self.export_incremental_every) and not self.export_dir:
            raise ConfigError("export_every / export_incremental_every need export_dir")
        if self.optimize.async_embedding and not self.ps_addresses:
            raise ConfigError("async_embedding pulls embedding rows from the parameter servers in the "
                              "SmartStage prefetch: it needs a parameter-server job (deeprec launch ... -- train)")
        if self.optimize.async_embedding and self.sync:
            raise ConfigError("sync training reads each step's rows after the previous update; async_embedding "
                              "reads them earlier: choose one")
        if self.num_shards > 1 and self.eval_fraction:
            raise ConfigError("a sharded worker cannot also hold out eval_fraction: give eval_data")

    @classmethod
    def create(cls, **values) -> "TrainConfig":
        """From field values where nested options may be dicts:
        `TrainConfig.create(data=[...], optimize={"smart_stage": True, "smart_stage_options": {"capacity": 4}})`."""
        return build(cls, values)


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
    if cfg.collective:  # every rank evaluates its share (deeprec.distributed.collective.evaluate_sharded)
        eval_kw.update(shard_index=cfg.shard_index, num_shards=cfg.num_shards)
    if cfg.eval_data:
        return open_reader(cfg.data, cfg.batch_size, **train_kw), open_reader(cfg.eval_data, cfg.eval_batch_size, **eval_kw)
    if cfg.eval_fraction:
        n, train_shards, eval_shard = _holdout_shards(cfg.eval_fraction)
        return (open_reader(cfg.data, cfg.batch_size, num_shards=n, shard_index=train_shards, **train_kw),
                open_reader(cfg.data, cfg.eval_batch_size, num_shards=n, shard_index=eval_shard, **eval_kw))
    return open_reader(cfg.data, cfg.batch_size, **train_kw), None


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
        if cfg.storage == "ssd":  # applied from outside: the model is written plainly
            variables = sum(isinstance(m, EmbeddingVariable) for m in self.model.modules())
            use_storage(self.model, StorageOption(tiers=["dram", "ssd"], dram_bytes=max(1, cfg.dram_bytes // max(1, variables)),
                                                  path=cfg.storage_path, cache=cfg.cache, prefetch=cfg.storage_prefetch))
        self.device = resolve_device(cfg.device)
        self.updater = make_updater(self.model, cfg.optimizer, cfg.lr, cfg.ps_addresses, cfg.protocol,
                                    sync_workers=cfg.num_shards if cfg.sync else 1, worker_index=cfg.shard_index,
                                    num_workers=cfg.num_shards, dense=cfg.dense, master=cfg.master,
                                    collective=cfg.collective, device=self.device,
                                    micro_batches=cfg.optimize.micro_batch_num)
        # after the optimizer: its row-sparse slots move with the tables
        self.host_tables = self.updater.host_tables if cfg.collective else place_model(self.model, self.device)
        optimize_config = cfg.optimize
        if self.device.type == "cuda":  # the stage runs on CPU into pinned memory, one copy on a side stream
            optimize_config = dataclasses.replace(optimize_config, stage_subgraph_on_cpu=True)
        self.fast = optimize(self.model, optimize_config)
        batch_norm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in self.model.modules())
        self.train_reader, self.eval_reader = make_readers(cfg, self.schema, drop_remainder=batch_norm)
        self._reader_state = self.train_reader.state_dict()  # position of the last batch trained on
        self.skipped_nonfinite = 0
        self.eval_history: list[dict] = []  # --eval-every
        self.exports = None
        if cfg.export_dir:
            from deeprec.serving.online import ExportWriter

            self.exports = ExportWriter(cfg.export_dir, self.model, self.schema, cfg.model)
        self._eval_start = self.eval_reader.state_dict() if self.eval_reader is not None else None
        if cfg.checkpoint_dir:
            remove_stale_temporaries(self.updater.checkpoint_dir(cfg.checkpoint_dir))
        if cfg.resume:
            self._restore()

    @property
    def step(self) -> int:
        return self.updater.step

    @property
    def evaluates(self) -> bool:
        """The chief evaluates; in collective training every rank does (each its share)."""
        return self.cfg.is_chief or self.cfg.collective

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
        """The newest intact full checkpoint, then the intact incremental ones after it, in
        order; a corrupt or incomplete one is skipped with a warning naming it. Collective
        training: the newest step all ranks saved, resharded onto this world size."""
        if self.cfg.collective:
            from deeprec.distributed.reshard import restore_collective

            found = restore_collective(self.cfg.checkpoint_dir, self.cfg.shard_index, self.cfg.num_shards)
            states, skipped, reader = [], [], None
            if found is not None:
                state, paths, same_world, skipped = found
                states = [(paths[0], state)]
                reader = state["reader"] if same_world else {  # a K-way position means nothing N-way
                    "epoch": state["reader_epoch"], "batches": 0, "fingerprint": self.train_reader.state_dict()["fingerprint"]}
                if not same_world:
                    self.console.print(f"resharded {len(paths)} ranks' checkpoints onto {self.cfg.num_shards} ranks; "
                                       f"the readers restart at the start of epoch {reader['epoch']}")
        else:
            states, skipped = self._checkpoint_chain()
            reader = states[-1][1]["reader"] if states else None
        for err in skipped:
            self.console.print(f"[yellow]warning:[/yellow] skipped {escape(str(err))}", highlight=False)
            log.warning("resume skipped %s", err)
        if not states:
            self.console.print(f"no checkpoint in {self.cfg.checkpoint_dir}: starting from step 0")
            return
        for path, state in states:
            if state["model_name"] != self.cfg.model:
                raise ConfigError(f"{path} holds a {state['model_name']!r} model, not {self.cfg.model!r}")
            self.updater.load_state_dict(state)
        self.train_reader.load_state_dict(reader)
        self._reader_state = reader
        torch.set_rng_state(state["torch_rng"])
        self.updater.step = int(state["step"])
        self.console.print(f"resumed from {', '.join(os.path.basename(path) for path, _ in states)} at step {self.step}")

    def _checkpoint_chain(self) -> tuple[list, list]:
        """[(path, state)] to load in order, and the problems skipped."""
        directory = self.updater.checkpoint_dir(self.cfg.checkpoint_dir)
        fulls, skipped, base, states = list_checkpoints(directory), [], None, []
        for path in reversed(fulls):
            try:
                states, base = [(path, load_checkpoint(path))], checkpoint_step(path)
                break
            except CheckpointError as err:
                skipped.append(err)
        if fulls and base is None:
            raise CheckpointError(f"no intact full checkpoint: {'; '.join(map(str, skipped))}", directory)
        for path in list_checkpoints(directory, "incremental"):
            if base is not None and checkpoint_step(path) <= base:
                continue
            try:
                states.append((path, load_checkpoint(path)))
            except CheckpointError as err:  # the later ones build on this one: stop here
                skipped.append(err)
                break
        return states, skipped

    # -- loop ------------------------------------------------------------------------
    def _export_now(self, final: bool = False) -> None:
        """--export-dir: a full export every --export-every steps, a delta every --export-incremental-every."""
        cfg, step = self.cfg, self.step
        if not cfg.is_chief or step == self.exports.last_step:
            return
        if cfg.export_every and step % cfg.export_every == 0:
            self.exports.full(step)
        elif (cfg.export_incremental_every and step % cfg.export_incremental_every == 0) or final:
            self.exports.delta(step)

    def _evaluate(self) -> dict:
        """One pass over the evaluation data from its start, in bounded memory."""
        self.updater.prepare_eval()
        self.eval_reader.load_state_dict(self._eval_start)
        if self.cfg.collective:
            from deeprec.distributed.collective import evaluate_sharded

            return evaluate_sharded(self.model, self._on_device(self.eval_reader, staged=False))
        return evaluate(self.model, self._on_device(self.eval_reader, staged=False))

    def _on_device(self, reader, staged: bool | None = None):
        """The reader's batches on the training device: SmartStage's stage copies what it cuts
        (pinned, side stream); a batch that skips the stage is pinned and copied whole."""
        staged = self.fast.staged if staged is None else staged
        return reader if self.device.type == "cpu" or staged else DeviceBatches(reader, self.device)

    def _evaluate_now(self, progress) -> None:
        """--eval-every: evaluate during training and keep the result."""
        if not self.evaluates:
            return
        metrics = self._evaluate()
        self.eval_history.append({"step": self.step, **metrics})
        progress.console.print(f"step {self.step} eval auc {metrics['auc']:.4f} logloss {metrics['logloss']:.4f} "
                               f"({metrics['rows']} rows)")

    def _nonfinite(self, what: str) -> None:
        """A step that was not applied (its loss or dense gradient is inf or nan)."""
        position = self._reader_state
        where = f"epoch {position['epoch']}, batch {position['batches']}" if position else "unknown position"
        if self.cfg.on_nan == "raise":
            raise NonFiniteError(f"non-finite {what} at step {self.step + 1} (reader {where}; the step was not "
                                 "applied): check the data and the learning rate, or --on-nan skip to skip such "
                                 "batches and count them")
        self.skipped_nonfinite += 1
        log.warning("skipped a batch with a non-finite %s at step %d (reader %s)", what, self.step, where)

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
        steps = self.fast.train_steps(self._on_device(self.train_reader), self.updater)
        with progress, contextlib.closing(steps):
            task = progress.add_task("train", total=total, completed=self.step, loss=float("nan"), rate=0.0)
            while total is None or self.step < total:
                with record_function("deeprec.step"):
                    out, self._reader_state = next(steps, (None, self._reader_state))
                if out is None:
                    break
                if "nonfinite" in out:
                    self._nonfinite(out["nonfinite"])
                    continue
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
                if self.exports is not None:
                    self._export_now()
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.eval_reader is not None:
                    self._evaluate_now(progress)
        self.updater.finish()
        if self.exports is not None:
            self._export_now(final=True)  # the served model catches up with the trained one
        elapsed = time.perf_counter() - started
        if cfg.checkpoint_dir and self.step > start_step:
            self.save()
        result = {"steps": self.step, "steps_this_run": self.step - start_step, "rows": rows,
                  "seconds": elapsed, "samples_per_s": rows / elapsed if elapsed > 0 else 0.0,
                  "final_loss": losses[-1] if losses else math.nan,
                  # after warm-up and SmartStage auto's calibration: the rate a long run keeps
                  "steady_samples_per_s": ((rows - steady[1]) / (started + elapsed - steady[0])
                                           if steady is not None and rows > steady[1] else None),
                  "bad_rows": self.train_reader.stats.bad_rows, "skipped_nonfinite": self.skipped_nonfinite}
        if self.fast.prefetch_stats is not None:
            result["stage"] = asdict(self.fast.prefetch_stats)
        if self.device.type != "cpu":
            result["device"] = str(self.device)
            result["tables_on_host"] = self.host_tables
        if hasattr(self.updater, "traffic"):  # collective training: all-to-all and all-reduce per step
            result["communication"] = self.updater.traffic()
        tiers = tier_summary(self.model)
        if tiers is not None:
            result["tiers"] = tiers
        if self.malloc_note:
            result["malloc"] = self.malloc_note
        if self.fast.bf16_note:
            result["bf16"] = ("on: " if self.fast.config.bf16 else "off: ") + self.fast.bf16_note
        if self.fast.auto_decision is not None:
            result["auto"] = self.fast.auto_decision.summary()
            result["auto_executor"] = self.fast.auto_decision.executor
        if self.eval_history:
            result["eval_history"] = self.eval_history
        if self.eval_reader is not None and self.evaluates:
            result["eval"] = self._evaluate()
        return result


def train(cfg: TrainConfig, console: Console | None = None) -> dict:
    """Train per `cfg`; returns throughput, final loss and eval metrics."""
    return Trainer(cfg, console).train()


__all__ = ["TrainConfig", "Trainer", "train", "evaluate", "asdict"]
