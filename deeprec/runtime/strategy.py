"""A `Strategy` per way of training: everything that differs between training in this
process, on parameter servers and collectively, so the trainer names no mode.

    Trainer                              Strategy
    ───────                              ────────
    cfg ───────────────────────────────> validate(cfg)            its own options' rules
    model over the data's schema ──────> model_overrides(cfg)     e.g. PS: EmbeddingVariables
                                         prepare(model, cfg, dev) lookup swaps, placement -> Updater
    readers ───────────────────────────> train_shards / eval_shards (this process's share)
    checkpoints ───────────────────────> checkpoint_dir(base), restore(base, ...)
    deeprec evaluate / export ─────────> read_one_process(saved), one_process_weights(model, state):
      (deeprec.strategies asks each)     a checkpoint of this way of training as a one-process model
    evaluation ────────────────────────> evaluate(model, batches) (distributed or not)
    serving exports while training ────> export_writer(...)
    the run's summary ─────────────────> summary()                (traffic, tier stats)

`LocalStrategy` is training in this process; `deeprec.distributed.ps.strategy.ParameterServer`
and `deeprec.distributed.collective.strategy.Collective` are the other two. The base class owns
what they share (the checkpoint chain, one-process evaluation); a subclass fills in its parts.
"""
from __future__ import annotations

import abc
import functools
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from deeprec.checkpoint import checkpoint_step, latest_checkpoint, list_checkpoints, load_checkpoint
from deeprec.errors import CheckpointError, ConfigError
from deeprec.runtime.updater import LocalUpdater, Updater


@dataclass
class Restored:
    """What a restore found: the states to load in order ([(path, state)]), the problems skipped,
    the reader position to continue from, and a line for the user (resharding)."""

    states: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    reader: dict | None = None
    note: str | None = None


class SavedCheckpoint:
    """What `deeprec evaluate --checkpoint` and `deeprec export --checkpoint` name: a checkpoint file,
    or a folder. `path`: the file, or the folder's newest full checkpoint (None: none at its top);
    `state`: that file's, loaded when first asked (several strategies look at it) and only once."""

    def __init__(self, location: str):
        self.location = location
        self.path = location if os.path.isfile(location) else latest_checkpoint(location)

    @functools.cached_property
    def state(self) -> dict | None:
        return None if self.path is None else load_checkpoint(self.path)


@dataclass
class OneProcessCheckpoint:
    """A checkpoint read as one process's model: its state (model_name, model_overrides, schema and
    step, as every checkpoint holds them), where it came from (a line for the user), and the
    strategy whose `one_process_weights` turn it into the one-process model's state dict."""

    state: dict
    source: str
    strategy: type[Strategy]

    def weights(self, model: nn.Module) -> dict:
        """The state dict of `model`, built as the checkpoint names it (one process, no swaps)."""
        return self.strategy.one_process_weights(model, self.state)


class Strategy(abc.ABC):
    name: str = "local"
    rank: int = 0  # this process's share of the data
    world_size: int = 1
    resume_reason: str | None = None  # set by validate: resume from --checkpoint-dir without --resume (a restart)

    @property
    def is_chief(self) -> bool:
        """Writes the checkpoint of shared state, the exports and the summary."""
        return self.rank == 0

    @property
    def evaluates(self) -> bool:
        return self.is_chief

    def validate(self, cfg) -> None:
        """Refuse the options this way of training does not support, naming the flag."""
        if cfg.optimize.async_embedding:
            raise ConfigError("async_embedding pulls embedding rows from the parameter servers in the "
                              "SmartStage prefetch: it needs a parameter-server job (deeprec launch ... -- train)")

    def model_overrides(self, cfg) -> dict:
        return {}

    @abc.abstractmethod
    def prepare(self, model: nn.Module, cfg, device: torch.device) -> Updater:
        """Swap what this way of training swaps, place the model; the Updater. `self.host_tables`:
        the lookups left on the host."""

    def train_shards(self) -> dict:
        return {"shard_index": self.rank, "num_shards": self.world_size} if self.world_size > 1 else {}

    def eval_shards(self) -> dict:
        return {}  # the chief evaluates the whole evaluation data

    def agree(self, stop: bool) -> bool:
        """Whether the run stops after this step, given this process's wish (a signal). Processes that
        step together (collective training) must agree, or one would wait for the others forever."""
        return stop

    def recover(self, trainer, err: BaseException) -> bool:
        """After `err` ended a step: put `trainer` back at a state to go on from (its step, reader
        position) and return True, or False to let the error end the run (here: always)."""
        return False

    # -- checkpoints -----------------------------------------------------------------
    def saves_after(self, err: Exception) -> bool:
        """Whether `err`, ending the run, lets this process save its last completed step first
        (deeprec.runtime.keep_work): here always."""
        return True

    def checkpoint_dir(self, base: str) -> str:
        return base

    def restore(self, base: str, train_reader) -> Restored:
        """The newest intact full checkpoint, then the intact incremental ones after it, in order;
        a corrupt or incomplete one is skipped (and named)."""
        directory = self.checkpoint_dir(base)
        fulls, found = list_checkpoints(directory), Restored()
        base_step = None
        for path in reversed(fulls):
            try:
                found.states, base_step = [(path, load_checkpoint(path))], checkpoint_step(path)
                break
            except CheckpointError as err:
                found.skipped.append(err)
        if fulls and base_step is None:
            raise CheckpointError(f"no intact full checkpoint: {'; '.join(map(str, found.skipped))}", directory)
        for path in list_checkpoints(directory, "incremental"):
            if base_step is not None and checkpoint_step(path) <= base_step:
                continue
            try:
                found.states.append((path, load_checkpoint(path)))
            except CheckpointError as err:  # the later ones build on this one: stop here
                found.skipped.append(err)
                break
        found.reader = found.states[-1][1]["reader"] if found.states else None
        return found

    @classmethod
    def read_one_process(cls, saved: SavedCheckpoint) -> OneProcessCheckpoint | None:
        """`saved` as a one-process model's checkpoint if this way of training wrote it, else None.
        Here: one process's checkpoint file (what `restore` reads first, from `checkpoint_dir`)."""
        if saved.state is None:
            return None
        return OneProcessCheckpoint(saved.state, saved.path, cls)

    @classmethod
    def one_process_weights(cls, model: nn.Module, state: dict) -> dict:
        """The state dict of the one-process `model` (built as `state` names it, before any swap) from
        a checkpoint `read_one_process` found."""
        return state["model"]

    # -- evaluation, exports, summary ---------------------------------------------------
    def evaluate(self, model: nn.Module, batches, **columns) -> dict:
        """The metrics of one pass over `batches`; `columns`: deeprec.metrics' group_by / item_by."""
        from deeprec.metrics import evaluate

        return evaluate(model, batches, **columns)

    def export_writer(self, directory: str, model: nn.Module, schema, spec: str, updater: Updater,
                      compile: bool | None = None):
        """Writes full exports (compiled, if `compile`; None: serving.compile_cache.compile_by_default)
        and deltas of the trained model while it trains (the chief's)."""
        from deeprec.serving.online import ExportWriter

        return ExportWriter(directory, model, schema, spec, compile=compile)

    @property
    def run_name(self) -> str | None:
        """This process's TensorBoard run under --log-dir (None: the folder itself)."""
        return None

    def counters(self, model: nn.Module, updater: Updater) -> dict[str, float]:
        """What TensorBoard plots of this way of training as it runs (--log-dir): here the tiers'."""
        from deeprec.nn.tiered import tier_summary

        tiers = tier_summary(model)
        keys = ("hit_rate", "dram_rows", "disk_rows", "bytes_read", "bytes_written")
        return {} if tiers is None else {f"tiers/{k}": float(tiers[k]) for k in keys}

    def summary(self, model: nn.Module, updater: Updater, result: dict) -> dict:
        """This way of training's lines of the run's result (`result`: this process's so far)."""
        from deeprec.nn.tiered import tier_summary

        tiers = tier_summary(model)
        return {} if tiers is None else {"tiers": tiers}


class LocalStrategy(Strategy):
    """Every parameter in this process: DenseOptimizer (fused) for dense ones, row-sparse optimizers attached
    to the embeddings."""

    def prepare(self, model: nn.Module, cfg, device: torch.device) -> Updater:
        from deeprec.optim import make_optimizer
        from deeprec.runtime.device import place_model

        updater = LocalUpdater(model, make_optimizer(model, cfg.optimizer.name, cfg.optimizer.lr))
        self.host_tables = place_model(model, device)  # after the optimizer: its slots move with the tables
        return updater


__all__ = ["Strategy", "LocalStrategy", "Restored", "SavedCheckpoint", "OneProcessCheckpoint"]
