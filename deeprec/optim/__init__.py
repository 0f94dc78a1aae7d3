"""Optimizers: fused dense ones (torch.optim's kernels) for dense parameters, row-sparse ones for embeddings."""
from deeprec.optim.fused import DenseOptimizer
from deeprec.optim.dense import OPTIMIZERS, OptimizerGroup, make_optimizer, sparse_parameters
from deeprec.optim.sparse import (FTRL, ROW_SPARSE, SGD, Adagrad, Adam, AdamAsync, RowSparseOptimizer,
                                  row_sparse_optimizer)

__all__ = ["DenseOptimizer", "OPTIMIZERS", "OptimizerGroup", "make_optimizer", "sparse_parameters", "FTRL", "SGD", "Adagrad",
           "Adam", "AdamAsync", "RowSparseOptimizer", "ROW_SPARSE", "row_sparse_optimizer"]
