"""Runtimes that execute optimized graphs: the prefetch stage, device transfer."""
from deeprec.runtime.hook import PrefetchHook, make_prefetch_hook
from deeprec.runtime.optimized import OptimizedModel, explain, optimize
from deeprec.runtime.prefetch import PrefetchRunner, PrefetchStats, StagedBatch

__all__ = ["OptimizedModel", "PrefetchHook", "PrefetchRunner", "PrefetchStats", "StagedBatch",
           "explain", "make_prefetch_hook", "optimize"]
