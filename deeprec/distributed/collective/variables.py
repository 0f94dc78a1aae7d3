"""Free EmbeddingVariables (`ev(ids)` in your own model) in collective training: sharded by key.

    ids [*] ──unique──> keys ──ShardedLookup.rows: all_to_all to each key's owner (key % 1000 % N),
    one lookup there (every rank's keys merged), rows back──> [U, D] ──inverse──> [*, D]

A ShardedVariable stands in for the EmbeddingVariable under every name it has (one module shared by
two features stays one), as the PS worker's RemoteVariable does. The rank keeps its shard of the
variable's rows in the variable itself, whose state it saves and loads under the same names as the
unsharded model: a rank's checkpoint merges and reshards like a collection's, and `deeprec
evaluate` or `deeprec export` read the merged one into the one-process model as it is written.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from deeprec.distributed.collective.planner import free_variables
from deeprec.distributed.collective.sharded import ShardedLookup
from deeprec.errors import ConfigError
from deeprec.nn.variable import EmbeddingVariable


class ShardedVariable(ShardedLookup):
    """This rank's shard of one free EmbeddingVariable: ids of any shape -> [*ids.shape, dim]."""

    def __init__(self, ev: EmbeddingVariable, group=None):
        if ev.optimizer is None:
            raise ConfigError(f"a sharded EmbeddingVariable{f' {ev.name!r}' if ev.name else ''} needs its row-sparse "
                              "optimizer: deeprec.optim.make_optimizer(model) before shard_embeddings")
        feature = SimpleNamespace(name=ev.name or "EmbeddingVariable", num_embeddings=None)
        super().__init__(SimpleNamespace(optimizer=ev.optimizer, num_pooled=0, max_norm=None, dim=ev.embedding_dim,
                                         features=[feature], dynamic=[True], variables=[ev]), group)
        self.embedding_dim = ev.embedding_dim

        self._apply_queued = False

    @property
    def variable(self) -> EmbeddingVariable:
        return self.variables[0]  # a plain list: its state is saved as this module's own (below)

    def forward(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids)
        keys, inverse, counts = torch.unique(ids.reshape(-1).to(torch.int64), return_inverse=True,
                                             return_counts=True)
        values = self.rows([keys.cpu()], [counts.cpu()]).to(ids.device)  # differentiable
        return values[inverse].reshape(*ids.shape, self.embedding_dim)

    def apply(self, plan: dict, grads: torch.Tensor) -> None:
        """Every rank's gradient of this rank's rows, kept; updating in backward (no CollectiveUpdater
        keeping them for the step), one update once the whole backward is done, as the unsharded
        variable does: a variable called for two features gets one update of both calls' gradients."""
        fused, self.fused = self.fused, False
        try:
            super().apply(plan, grads)  # kept in _pending
        finally:
            self.fused = fused
        if fused and not self._apply_queued:
            self._apply_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._apply_after_backward)

    def _apply_after_backward(self) -> None:
        self._apply_queued = False
        if self.fused:
            self.apply_pending()

    # the variable's state under this module's name, as the unsharded model holds it (its own
    # optimizer's step count included); no extra state of ShardedLookup's
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self.variable._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        self.variable._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                            unexpected_keys, error_msgs)

    get_extra_state = nn.Module.get_extra_state
    set_extra_state = nn.Module.set_extra_state

    def explain(self) -> list[str]:
        return [f"{self.variable.name or 'EmbeddingVariable'}: rows on rank key % 1000 % {self.world} "
                "(a free EmbeddingVariable, sharded by all-to-all)"]

    def extra_repr(self) -> str:
        return f"{self.variable.extra_repr()}, rank {self.rank} of {self.world}"


def shard_variables(model: nn.Module, group=None) -> int:
    """Swap every free EmbeddingVariable of `model` (not an EmbeddingCollection's table) for this
    rank's ShardedVariable, wherever it is registered; returns how many variables."""
    from deeprec.nn.shared import replace_module

    free = free_variables(model)
    for ev in free:
        replace_module(model, ev, ShardedVariable(ev, group))
    return len(free)


__all__ = ["ShardedVariable", "shard_variables"]
