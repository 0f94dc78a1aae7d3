"""Collective training (a torchrun rank) as a `Strategy` (deeprec.runtime.strategy).

    rank r of N ──reads its share──> CollectiveUpdater: EmbeddingCollections and free EmbeddingVariables
    (your own model's ev(ids)) sharded by all-to-all, dense gradients all-reduced; checkpoints per rank
    (rank-r-of-N/), resharded onto another N (onto one process: read_one_process, for deeprec evaluate
    and export);
    evaluation: every rank its share of the evaluation data, in lockstep, metrics all-reduced
"""
from __future__ import annotations

import os

import torch
from torch import nn

from deeprec.errors import ConfigError
from deeprec.runtime.strategy import OneProcessCheckpoint, Restored, Strategy


class Collective(Strategy):
    name = "collective"

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    @property
    def evaluates(self) -> bool:
        return True  # every rank evaluates its share

    def validate(self, cfg) -> None:
        from deeprec.distributed.collective.elastic import resume_reason

        self.resume_reason = resume_reason(cfg, self.rank)  # restarted by an agent: resume from the checkpoint
        if cfg.model.embedding == "torch":
            raise ConfigError("collective training (torchrun) shards EmbeddingCollections: --embedding torch "
                              "(nn.Embedding) is not sharded; give --embedding table or variable")
        if cfg.training.steps is None:
            raise ConfigError("collective training (torchrun) needs --steps: every rank must take the same "
                              "number of steps (each exchanges ids with the others)")
        if cfg.checkpoint.incremental_every:
            raise ConfigError("incremental checkpoints of collective training are not implemented: drop "
                              "--incremental-every (full checkpoints with --checkpoint-every work)")
        if cfg.training.on_nan == "skip":
            raise ConfigError("on_nan='skip' is not supported with collective training (torchrun): every rank "
                              "takes every step together; a non-finite step stops every rank (use on_nan='raise')")
        if cfg.optimize.async_embedding:
            raise ConfigError("async_embedding is not supported with collective training (torchrun): the id "
                              "exchange is a collective every rank runs in the same order inside the step, not "
                              "ahead of it in SmartStage; drop --async-embedding (SmartStage and --micro-batch work)")
        if cfg.export.dir:
            raise ConfigError("serving exports of collective training (torchrun) are not implemented: drop "
                              "--export-dir and export the checkpoint folder with deeprec export")
        if cfg.data.eval_fraction:
            raise ConfigError("a rank reads its share of --data and cannot also hold out --eval-fraction: give "
                              "--eval-data (every rank evaluates its share)")
        if cfg.data.follow:
            raise ConfigError("--follow is not supported with collective training (torchrun): a rank waiting for new "
                              "files would stall every other rank's exchange; follow with a PS job or one process")

    def prepare(self, model: nn.Module, cfg, device: torch.device):
        from deeprec.distributed.collective.updater import CollectiveUpdater

        updater = CollectiveUpdater(model, cfg.optimizer.name, cfg.optimizer.lr, self.rank, self.world_size, device,
                                    overlap=cfg.optimize.micro_batch_num == 1,  # micro-batches: after the last
                                    timeout_s=cfg.distributed.collective_timeout)
        self.host_tables, self._updater = updater.host_tables, updater
        import torch.distributed as dist

        from deeprec.distributed.collective.deadline import guard, timeout

        # agree(): on the CPU, no device sync per step; the group's timeout is --collective-timeout
        with guard("creating the stop agreement's group"):
            self._stop_group = dist.new_group(backend="gloo", timeout=timeout())
        return updater

    def agree(self, stop: bool) -> bool:
        """Every rank stops after the same step: a one-int all-reduce (MAX) per step, on a gloo group
        of its own (tens of microseconds on the host; never a device synchronization)."""
        import torch.distributed as dist

        from deeprec.distributed.collective.deadline import current, guard

        flag = torch.tensor([int(stop)])
        with guard("the stop agreement"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._stop_group)
        if current() is not None:  # an error names the step it gave up in
            current().steps_done = self._updater.step
        return bool(flag.item())

    def train_shards(self) -> dict:
        return {"shard_index": self.rank, "num_shards": self.world_size}

    def eval_shards(self) -> dict:
        return self.train_shards()

    def saves_after(self, err: Exception) -> bool:
        """Never: the ranks save one step together, and one rank's save alone is no resume point."""
        return False

    def checkpoint_dir(self, base: str) -> str:
        from deeprec.distributed.collective.reshard import rank_dir

        return rank_dir(base, self.rank, self.world_size)

    def restore(self, base: str, train_reader) -> Restored:
        """The newest step all ranks of one world size saved, resharded onto this one."""
        from deeprec.distributed.collective.reshard import restore_collective

        found = restore_collective(base, self.rank, self.world_size)
        if found is None:
            return Restored()
        state, paths, same_world, skipped = found
        restored = Restored(states=[(paths[0], state)], skipped=skipped, reader=state.get("reader"))
        if not same_world:  # a K-way reader position means nothing N-way
            restored.reader = {"epoch": state["reader_epoch"], "batches": 0,
                               "fingerprint": train_reader.state_dict()["fingerprint"]}
            restored.note = (f"resharded {len(paths)} ranks' checkpoints onto {self.world_size} ranks; the readers "
                             f"restart at the start of epoch {restored.reader['epoch']}")
        return restored

    @classmethod
    def read_one_process(cls, saved):
        """A collective job's folder (rank-R-of-N subfolders, no checkpoint at its top): the newest
        step all ranks of one world size saved, every rank's shards merged, as `restore` reads it
        onto one rank."""
        from deeprec.distributed.collective.reshard import restore_collective

        if saved.path is not None or not os.path.isdir(saved.location):
            return None
        found = restore_collective(saved.location, 0, 1)
        if found is None:
            return None
        state, paths, _, _ = found
        return OneProcessCheckpoint(state, f"{saved.location} ({len(paths)} ranks' {os.path.basename(paths[0])}, "
                                           "merged)", cls)

    @classmethod
    def one_process_weights(cls, model: nn.Module, state: dict) -> dict:
        """Each fixed table's rows, saved per rank, back into its one weight (reshard.one_process_state)."""
        from deeprec.distributed.collective.reshard import one_process_state

        return one_process_state(model, state["model"])

    def evaluate(self, model: nn.Module, batches, **columns) -> dict:
        from deeprec.distributed.collective.sharded import evaluate_sharded

        return evaluate_sharded(model, batches, **columns)

    @property
    def run_name(self) -> str:
        return f"rank-{self.rank}"

    def counters(self, model: nn.Module, updater) -> dict[str, float]:
        """The all-to-all and dense all-reduce per step so far (ms, bytes, calls)."""
        traffic = {f"collective/{k}": float(v) for k, v in updater.traffic().items()
                   if k not in ("steps", "ranks", "dense_parameters")}
        return {**super().counters(model, updater), **traffic}

    def summary(self, model: nn.Module, updater, result: dict) -> dict:
        """Communication per step, and the job's totals (every rank's rows; the slowest rank's time)."""
        import torch.distributed as dist

        from deeprec.distributed.collective.deadline import guard
        from deeprec.distributed.collective.sharded import _default_group_device

        rows = torch.tensor([float(result["rows"])], dtype=torch.float64, device=_default_group_device())
        seconds = torch.tensor([float(result["seconds"])], dtype=torch.float64, device=_default_group_device())
        with guard("the all-reduce of the job's totals"):
            dist.all_reduce(rows)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        job = {"ranks": self.world_size, "rows": int(rows.item()),
               "samples_per_s": rows.item() / seconds.item() if seconds.item() > 0 else 0.0}
        return {**super().summary(model, updater, result), "communication": updater.traffic(), "job": job}


__all__ = ["Collective"]
