"""Optimizers: torch.optim for dense parameters, row-sparse ones for embeddings."""
from deeprec.optim.dense import OPTIMIZERS, OptimizerGroup, make_optimizer, sparse_parameters
from deeprec.optim.sparse import FTRL, SGD, Adagrad, Adam, AdamAsync, RowSparseOptimizer, merge_rows

__all__ = ["OPTIMIZERS", "OptimizerGroup", "make_optimizer", "sparse_parameters", "FTRL", "SGD", "Adagrad",
           "Adam", "AdamAsync", "RowSparseOptimizer", "merge_rows"]
