"""The stage of an optimized model run ahead over a reader (the seed's `tf.make_prefetch_hook()`).

    with make_prefetch_hook(fast, reader) as batches:    reader ──> stage (runner threads or a
        for staged in batches:                            process) ──> buffer ──> StagedBatch
            fast(staged)                                  ──> fast(...) runs the rest of the step

The hook budgets threads (stage + the step's intra-op <= cores), starts the prefetching lookups'
pulls right after each batch's stage ran, and joins every thread on exit.
"""
from __future__ import annotations

import dataclasses
import os

import torch
from torch.profiler import record_function

from deeprec.runtime.prefetch import PrefetchRunner
from deeprec.runtime.transfer import PackedCopier


class PrefetchHook:
    """Runs the stage of `fast` over `reader` in background threads while the
    `with` block lasts; iterating yields `StagedBatch`es for `fast(...)`.
    Every thread is joined on exit, whatever ends the block."""

    def __init__(self, fast, reader, options=None, main_threads: int | None = None, stats=None):
        if not fast.staged:
            raise ValueError("make_prefetch_hook needs a model with a stage: use "
                             "dr.Config(smart_stage=True) or dr.staged(...) in forward")
        self.fast, self.reader = fast, reader
        self.options = options or fast.config.smart_stage_options
        if self.options.executor == "auto":  # a hand-written loop runs the stage ahead in a thread
            self.options = dataclasses.replace(self.options, executor="thread")
        self.main_threads = main_threads
        self._stats = stats  # a PrefetchStats to count on (SmartStage auto's, across its phases)
        self.runner: PrefetchRunner | None = None
        self._saved_threads = None

    def __enter__(self) -> "PrefetchHook":
        cfg = self.fast.config
        opts = self.options
        pool = cfg.stage_pool()
        transfer = None
        if self.fast.device.type == "cuda" and cfg.stage_subgraph_on_cpu:
            transfer = PackedCopier(self.fast.device, opts.stage_subgraph_stream_id)
        stage_threads = pool.num_threads * pool.intra_op_threads if pool else opts.num_threads
        main_threads = self.main_threads or cfg.main_threads or max(1, (os.cpu_count() or 1) - stage_threads)
        self._saved_threads = torch.get_num_threads()
        torch.set_num_threads(main_threads)  # background + intra-op <= cores
        after_stage = _start_pulls(self.fast.async_lookups, self.fast.tier_lookups) \
            if self.fast.async_lookups or self.fast.tier_lookups else None
        self.runner = PrefetchRunner(self.reader, self.fast.partition.stage, opts, pool=pool,
                                     transfer=transfer, after_stage=after_stage, name=opts.name, stats=self._stats)
        return self

    def __iter__(self):
        try:
            while True:
                try:
                    yield self.runner.take()
                except StopIteration:
                    return
        finally:
            self.runner.client_finished()

    def __exit__(self, *exc) -> None:
        self.runner.close()
        for lookup, _ in self.fast.async_lookups + self.fast.tier_lookups:
            lookup.discard_prefetched()  # batches staged but never trained on
        torch.set_num_threads(self._saved_threads)

    @property
    def stats(self):
        return self.runner.stats


def _start_pulls(lookups: list, tier_lookups: list = ()):
    """after_stage callback: pull each remote lookup's rows for the batch just staged, and
    promote each tiered lookup's rows from disk into DRAM."""
    def pull(values: tuple) -> None:
        for lookup, index in lookups:
            with record_function("deeprec.ps.async_pull"):
                lookup.prefetch(values[index], train=lookup.training)
        for lookup, index in tier_lookups:
            with record_function("deeprec.tiers.prefetch"):
                lookup.prefetch(values[index], train=lookup.training)
    return pull


def make_prefetch_hook(fast, reader) -> PrefetchHook:
    """Context manager for hand-written loops (the seed's `tf.make_prefetch_hook()`)."""
    return PrefetchHook(fast, reader)
