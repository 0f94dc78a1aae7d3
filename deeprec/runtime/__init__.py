"""Runtimes that execute optimized graphs: the prefetch stage, device transfer."""
from deeprec.runtime.optimized import OptimizedModel, PrefetchHook, explain, make_prefetch_hook, optimize
from deeprec.runtime.prefetch import PrefetchRunner, PrefetchStats, StagedBatch

__all__ = ["OptimizedModel", "PrefetchHook", "PrefetchRunner", "PrefetchStats", "StagedBatch",
           "explain", "make_prefetch_hook", "optimize"]
