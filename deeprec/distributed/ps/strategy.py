"""Training on parameter servers, as a `Strategy` (deeprec.runtime.strategy).

    worker i of N ──reads its share of the data──> PSUpdater: EmbeddingVariables (in collections or
    your own ev(ids)) become PS variables; dense layers replicated and all-reduced, or on the PSs
    checkpoints: the chief's folder holds every PS's rows and the dense model; worker i's in worker-i/
    exports while training: the chief keeps a one-process twin of the model; each export copies the
    dense weights into it and pulls the rows the PSs updated since the last export

A PS checkpoint reads back as a one-process model (`ParameterServer.read_one_process`, then
`one_process_state`), so `deeprec evaluate` and `deeprec export` take it like any other.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from deeprec.errors import ConfigError
from deeprec.runtime.strategy import OneProcessCheckpoint, Strategy


class ParameterServer(Strategy):
    name = "parameter_server"

    def __init__(self, ps_addresses: list[str], worker_index: int = 0, num_workers: int = 1,
                 master: str | None = None):
        if not ps_addresses:
            raise ConfigError("a parameter-server worker needs the PS addresses (TF_CONFIG's ps job)")
        self.ps_addresses, self.master = list(ps_addresses), master
        self.rank, self.world_size = worker_index, num_workers

    def validate(self, cfg) -> None:
        if cfg.checkpoint.incremental_every:
            raise ConfigError("incremental checkpoints of parameter-server training are not implemented: drop "
                              "--incremental-every (full checkpoints with --checkpoint-every work)")
        if cfg.model.embedding not in (None, "variable"):
            raise ConfigError("parameter-server training keeps embeddings as EmbeddingVariables: "
                              f"--embedding {cfg.model.embedding} is not supported there; drop it or give variable")
        if cfg.training.device != "cpu":
            raise ConfigError("parameter-server training runs on the CPU here: --device cuda/auto is for local and "
                              "collective (torchrun) training")
        if cfg.storage.tiered:
            raise ConfigError("--storage ssd tiers EmbeddingVariables of local training; a PS shard tiers its rows "
                              "itself: python -m deeprec.distributed.ps --storage ssd --dram-bytes N")
        if cfg.optimize.async_embedding and cfg.distributed.sync:
            raise ConfigError("sync training reads each step's rows after the previous update; async_embedding "
                              "reads them earlier: choose one")
        if self.world_size > 1 and cfg.data.eval_fraction:
            raise ConfigError("a worker of several reads its share of --data and cannot also hold out "
                              "--eval-fraction: give --eval-data (the chief evaluates it)")

    def model_overrides(self, cfg) -> dict:
        return {"embedding": "variable"}  # a zoo model's tables as EmbeddingVariables

    def prepare(self, model: nn.Module, cfg, device: torch.device):
        from deeprec.distributed.ps.client import PSClient
        from deeprec.distributed.ps.worker import PSUpdater

        self.twin = copy.deepcopy(model) if cfg.export.dir and self.is_chief else None  # before the swap
        self.host_tables = []
        return PSUpdater(model, PSClient(self.ps_addresses, cfg.distributed.protocol, cfg.distributed.ps_deadline), cfg.optimizer.name, cfg.optimizer.lr,
                         sync_workers=self.world_size if cfg.distributed.sync else 1, worker_index=self.rank,
                         num_workers=self.world_size, dense=cfg.distributed.dense, master=self.master)

    def recover(self, trainer, err: BaseException) -> bool:
        """A PS restarted: roll every worker back to the last checkpoint (deeprec.distributed.ps.rollback)."""
        from deeprec.distributed.ps.rollback import roll_back

        return roll_back(trainer, self, err)

    @property
    def run_name(self) -> str:
        return f"worker-{self.rank}"

    def counters(self, model: nn.Module, updater) -> dict[str, float]:
        """RPC traffic to the PSs per step so far (bytes each way, calls)."""
        client, steps = updater.client, max(1, updater.step)
        return {**super().counters(model, updater), "ps/bytes_sent_per_step": client.bytes_sent / steps,
                "ps/bytes_received_per_step": client.bytes_received / steps, "ps/calls_per_step": client.calls / steps}

    def saves_after(self, err: Exception) -> bool:
        """Unless the PSs failed: the save needs them (it would wait out --ps-deadline again)."""
        from deeprec.distributed.ps.client import PSError

        return not isinstance(err, PSError)

    def checkpoint_dir(self, base: str) -> str:
        import os

        return base if self.is_chief else os.path.join(base, f"worker-{self.rank}")

    @classmethod
    def read_one_process(cls, saved):
        """A PS job's checkpoint: the chief's, at the top of the job's folder, holds the dense model and
        every PS's rows. A worker's own (in worker-<i>/, older ones with only its reader position) is
        refused, naming the folder to give instead."""
        state = saved.state
        if state is None or ("ps" not in state and "model" in state):
            return None  # not a PS job's
        if "ps" not in state:
            raise ConfigError(f"{saved.path} is a parameter-server worker's checkpoint (its reader position): give "
                              "the job's checkpoint folder, whose top level holds the chief's")
        return OneProcessCheckpoint(state, f"{saved.path} (parameter-server job: the PSs' rows merged)", cls)

    @classmethod
    def one_process_weights(cls, model: nn.Module, state: dict) -> dict:
        return one_process_state(model, state)

    def export_writer(self, directory: str, model: nn.Module, schema, spec: str, updater, compile: bool | None = None):
        from deeprec.serving.online import ExportWriter

        return PSExportWriter(ExportWriter(directory, self.twin, schema, spec, compile=compile), model, updater)


class PSExportWriter:
    """Full exports and deltas of a PS-trained model, from the chief: the twin (a one-process copy
    of the model) gets the trained dense weights and the rows the PSs updated since its last sync."""

    def __init__(self, writer, model: nn.Module, updater):
        self.writer, self.model, self.updater = writer, model, updater
        self.synced: list[dict] = []  # per PS: {variable: its optimizer's step there, already in the twin}
        self.syncs = 0  # the twin's row versions: rows pulled by sync k get version k (PS versions are per PS)

    @property
    def last_step(self):
        return self.writer.last_step

    def _sync(self) -> None:
        from deeprec.distributed.ps.worker import ps_variables

        self.updater.prepare_eval()  # a held push sent, dense parameters pulled (dense="ps")
        twin = self.writer.model
        dense = {k: v for k, v in self.model.state_dict().items()}
        twin.load_state_dict(dense, strict=False)
        parts = self.updater.client.export(self.synced or None)
        self.synced, self.syncs = [{} for _ in parts], self.syncs + 1
        for name, ev in ps_variables(twin).items():
            prefix = f"emb/{name}/"
            for ps, part in enumerate(parts):
                rows = {k[len(prefix):]: v for k, v in part.items() if k.startswith(prefix)}
                if not rows:
                    continue
                self.synced[ps][name] = int(rows["global_step"])
                ev.load({**rows, "version": torch.full_like(rows["version"], self.syncs),
                         "global_step": torch.tensor(self.syncs), "incremental": torch.tensor(True)})

    def full(self, step: int) -> str:
        self._sync()
        return self.writer.full(step)

    def delta(self, step: int) -> str:
        self._sync()
        return self.writer.delta(step)


def one_process_state(model: nn.Module, state: dict) -> dict:
    """A PS chief's checkpoint as the state dict of the one-process `model` (built as trained,
    before any swap): the dense model the worker saved, every EmbeddingVariable's rows from the PSs."""
    from deeprec.distributed.ps.worker import ps_variables
    from deeprec.nn.shared import module_paths

    out = dict(state.get("model") or {})
    snapshot = state["ps"]
    if "dense" in state:  # replicas of dense="allreduce" (older checkpoints hold no "model")
        out.update(state["dense"])
    out.update({k[len("dense/"):]: v for k, v in snapshot.items() if k.startswith("dense/")})  # dense="ps"
    paths_of = module_paths(model)  # an EmbeddingVariable under several names: its rows under each
    for name, ev in ps_variables(model).items():
        prefix = f"emb/{name}/"
        rows = {k[len(prefix):]: v for k, v in snapshot.items() if k.startswith(prefix)}
        if not rows:
            raise ConfigError(f"the PS checkpoint holds no rows of {name!r}: was it written by this model?")
        for path in paths_of[id(ev)]:
            out.update({f"{path}.{k}": v for k, v in rows.items()})
    for name, value in model.state_dict().items():
        if name not in out and name.endswith("_extra_state"):  # a local lookup's optimizer: on the PSs instead
            out[name] = value
        elif name in out and out[name].numel() == value.numel() and out[name].shape != value.shape:
            out[name] = out[name].reshape(value.shape)  # dense="ps" keeps flat views
    return out


__all__ = ["ParameterServer", "PSExportWriter", "one_process_state"]
