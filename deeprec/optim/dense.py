"""Optimizers for models mixing embeddings and dense layers.

Dense parameters step through `DenseOptimizer` (deeprec/optim/fused.py: torch.optim's fused
kernels, one call a step). Its Adagrad and SGD also take sparse gradients (nn.Embedding with
sparse=True); Adam does not, so "adam" pairs torch.optim.SparseAdam (those embeddings) with it.
"""
from __future__ import annotations

import torch
from torch import nn

from deeprec.errors import check_choice
from deeprec.nn.lookup import embedding_lookups
from deeprec.optim.fused import DenseOptimizer
from deeprec.optim.sparse import row_sparse_optimizer

OPTIMIZERS = ("adagrad", "adam", "sgd")  # the names make_optimizer (and `deeprec train --optimizer`) takes


def sparse_parameters(model: nn.Module) -> set[int]:
    """ids of the weights of `nn.Embedding`/`nn.EmbeddingBag` modules with sparse=True."""
    return {id(m.weight) for m in model.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}


class OptimizerGroup:
    """Several optimizers (DenseOptimizer, torch.optim's) stepped as one (state_dict keeps them apart), and the
    embedding lookups (`deeprec.nn.EmbeddingLookup`) whose row-sparse update was kept for
    the step (micro-batching: rows seen in several micro-batches are merged, then updated once)."""

    def __init__(self, optimizers: list, lookups: list = ()):
        self.optimizers, self.lookups = optimizers, list(lookups)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()
        for lookup in self.lookups:
            lookup.apply_pending()  # nothing kept (the update ran in backward): nothing to do

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the dense gradients and the embedding rows kept for the step."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)
        for lookup in self.lookups:
            lookup.discard_pending()

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for opt, s in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(s)


def attach_row_sparse(model: nn.Module, name: str, lr: float) -> list:
    """Give every embedding lookup of `model` (deeprec.nn.EmbeddingLookup: an EmbeddingCollection's
    tables, a free EmbeddingVariable) the row-sparse version of `name` (its update runs in the
    backward, or at the optimizer step when micro-batching keeps it); returns the lookups."""
    lookups = [lookup for _, lookup in embedding_lookups(model)]
    for lookup in lookups:  # each its own optimizer: its own step count and slots
        lookup.set_optimizer(row_sparse_optimizer(name, lr))
    return lookups


def make_optimizer(model: nn.Module, name: str = "adagrad", lr: float = 0.05) -> OptimizerGroup:
    """The optimizer `name` (one of OPTIMIZERS) for all of `model`: torch.optim for dense
    parameters, and the row-sparse counterpart attached to every EmbeddingCollection and
    free EmbeddingVariable (so restore a checkpoint after calling this). Its `step()`
    also applies embedding rows kept over micro-batches."""
    check_choice("optimizer", name, OPTIMIZERS)
    lookups = attach_row_sparse(model, name, lr)
    return OptimizerGroup(dense_optimizers(model, name, lr), lookups)


def dense_optimizers(model: nn.Module, name: str, lr: float) -> list:
    """`name` over the model's trainable parameters: a DenseOptimizer (Adam: torch.optim.SparseAdam
    for sparse-gradient embeddings beside it). torch.optim's state_dict format, as before."""
    check_choice("optimizer", name, OPTIMIZERS)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return []
    if name == "adagrad":
        return [DenseOptimizer(params, "adagrad", lr=lr, initial_accumulator_value=0.1)]
    if name == "sgd":
        return [DenseOptimizer(params, "sgd", lr=lr)]
    sparse_ids = sparse_parameters(model)
    sparse = [p for p in params if id(p) in sparse_ids]
    dense = [p for p in params if id(p) not in sparse_ids]
    group = [DenseOptimizer(dense, "adam", lr=lr)] if dense else []
    if sparse:
        group.append(torch.optim.SparseAdam(sparse, lr=lr))
    return group
