"""Collective training's swap and updater: `shard_embeddings` puts this rank's sharded lookups in a
model (ShardedLookup for each EmbeddingCollection, ShardedVariable for each free EmbeddingVariable),
`CollectiveUpdater` is the trainer's updater under torchrun."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from deeprec.distributed.collective import deadline
from deeprec.distributed.collective.deadline import guard
from deeprec.distributed.collective.sharded import ShardedLookup
from deeprec.distributed.collective.variables import shard_variables
from deeprec.errors import ConfigError, NonFiniteError
from deeprec.nn.collection import EmbeddingCollection, FusedLookup
from deeprec.runtime.updater import LocalUpdater


def shard_embeddings(model: nn.Module, group=None) -> int:
    """Swap every EmbeddingCollection's lookup for this rank's ShardedLookup, and every free
    EmbeddingVariable (`ev(ids)` in your own model, under each of its names) for a ShardedVariable
    (torch.distributed initialized; the optimizer attached before). Returns how many."""
    if not dist.is_initialized():
        raise ConfigError("shard_embeddings needs torch.distributed: torch.distributed.init_process_group "
                          "(torchrun sets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)")
    swapped = 0
    for collection in [m for m in model.modules() if isinstance(m, EmbeddingCollection)]:
        if isinstance(collection.lookup, FusedLookup):
            collection.lookup = ShardedLookup(collection.lookup, group)
            swapped += 1
    return swapped + shard_variables(model, group)


class CollectiveUpdater(LocalUpdater):
    """The trainer's updater under torchrun (`torchrun --nproc-per-node N -m deeprec train ...`):
    embeddings sharded by all-to-all, dense gradients averaged by bucketed all-reduces launched
    during the backward (deeprec.distributed.allreduce.DenseAllReduce), then one step of everything.

    The owners keep their rows' gradients until `apply` (ShardedLookup.fused False): a step whose
    averaged dense gradients are not finite (any rank's inf or nan spreads into the mean, so every
    rank sees it) is then dropped whole on every rank, and every rank stops with NonFiniteError."""

    def __init__(self, model: nn.Module, optimizer: str, lr: float, rank: int, world_size: int,
                 device: torch.device = torch.device("cpu"), overlap: bool = True,
                 timeout_s: float = deadline.DEFAULT_TIMEOUT_S):
        from deeprec.distributed.allreduce import (DenseAllReduce, broadcast_parameters, join_process_group,
                                                  rendezvous_from_env)
        from deeprec.optim import make_optimizer
        from deeprec.runtime.device import move_dense, place_tables

        super().__init__(model, make_optimizer(model, optimizer, lr))  # row-sparse ones travel with the lookups
        self.rank, self.world_size = rank, world_size
        move_dense(model, device)  # the all-reduce runs where the dense layers are: NCCL on a GPU
        dense = [p for p in model.parameters() if p.requires_grad]
        rendezvous = rendezvous_from_env(rank, world_size)
        limit = deadline.install(timeout_s, rank, world_size, rendezvous.master_addr, rendezvous.master_port)
        with guard("the rendezvous (creating the process group)"):
            join_process_group(rendezvous, device, timeout_s=timeout_s)
        limit.start_heartbeat()
        broadcast_parameters(dense)  # the replicas start equal
        self.reducer = DenseAllReduce(dense, overlap=overlap)
        if not shard_embeddings(model):  # on the host: a rank moves only its shard to the GPU
            raise ConfigError("collective training shards the model's EmbeddingCollections and EmbeddingVariables: "
                              "this model has none (--embedding torch keeps nn.Embedding tables: give --embedding "
                              "variable or fused)")
        self.optimizer.lookups = [m for m in model.modules() if isinstance(m, ShardedLookup)]
        for lookup in self.optimizer.lookups:
            lookup.fused = False  # rows updated in apply, after the finite check
        self.host_tables = place_tables(model, device)

    def apply(self) -> None:
        self.reducer.average_gradients()
        if not self.reducer.finite():
            self._drop("dense gradient (averaged over the ranks)")
        super().apply()

    def discard(self) -> None:
        self.reducer.average_gradients()  # the other ranks' all-reduces need this rank's part
        self._drop("loss or gradient on this rank")

    def _drop(self, what: str) -> None:
        self.optimizer.zero_grad()  # dense gradients and the rows' kept gradients: nothing applied
        raise NonFiniteError(f"non-finite {what} at step {self.step + 1}: every rank stops, nothing of the step "
                             "was applied (the last checkpoint is intact); check the data and the learning rate. "
                             "Collective training cannot skip a step (--on-nan skip is for single-process training)")

    def traffic(self) -> dict:
        """Communication per step so far: all-to-all (ids, rows, gradients) and the dense all-reduce."""
        lookups = [m.traffic for m in self.model.modules() if isinstance(m, ShardedLookup)]
        steps = max(1, self.step)
        reduce = self.reducer
        return {"steps": self.step, "ranks": self.world_size,
                "all_to_all_ms": 1e3 * sum(t.seconds for t in lookups) / steps,
                "all_to_all_bytes": sum(t.bytes_sent for t in lookups) / steps,
                "all_to_all_calls": sum(t.calls for t in lookups) / steps,
                "all_reduce_ms": 1e3 * reduce.traffic.seconds / steps,  # waited for in apply: not hidden
                "all_reduce_bytes": reduce.traffic.bytes_sent / steps,
                "dense_parameters": reduce.numel}


__all__ = ["shard_embeddings", "CollectiveUpdater"]
