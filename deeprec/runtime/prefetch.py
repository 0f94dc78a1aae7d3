"""Prefetch runtime: runner threads execute the stage ahead into a bounded buffer.

    reader ──next()──┐
                     ├─ runner thread 1: stage(batch) [-> packed H2D copy] ─┐
                     └─ runner thread N: stage(batch) [-> packed H2D copy] ─┴─> buffer (capacity) ──take()──> step

Pulling from the reader happens under a lock and numbers each batch; with
`ordered=True` results leave the buffer in that order. Every outcome of a
batch is accounted for: delivered, dropped after `timeout_millis` (warned and
counted), skipped for an ignored exception (warned and counted), the end of the
stream (closed exception types), or an error re-raised in the consumer with its
original traceback. `close()` stops and joins every thread.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch.profiler import record_function

from deeprec.config import SmartStageOptions, ThreadPoolOptions
from deeprec.runtime.stage_process import Prestaged, ProcessSource, StageBatchIgnored, StageStreamEnd

log = logging.getLogger("deeprec.prefetch")
_JOIN_SECONDS = 60.0


def _prestaged_values(item: Prestaged):
    return item.values


@dataclass
class PrefetchStats:
    pulled: int = 0  # batches taken from the reader
    prefetched: int = 0  # stage results put in the buffer (or staged inline: SmartStage auto's inline phases)
    taken: int = 0  # results handed to the training loop
    dropped: int = 0  # results dropped after waiting timeout_millis for buffer space
    ignored: int = 0  # batches skipped for an ignored exception type
    stage_seconds: float = 0.0  # summed over runner threads (pull + stage + copy) or inline read + stage; the
    # process executor's runner times its wait for a batch the worker staged


@dataclass
class StagedBatch:
    """Stage outputs of one batch, ready for the main step."""

    values: tuple
    seq: int
    source_state: dict | None = None  # reader position after this batch (for checkpoints)
    ready: Any = None  # CUDA event the main stream waits on, when copied on a side stream
    keepalive: Any = field(default=None, repr=False)  # pinned host buffer of an in-flight copy


class PrefetchRunner:
    def __init__(self, source: Iterable, stage_fn: Callable[[Any], tuple], options: SmartStageOptions,
                 *, pool: ThreadPoolOptions | None = None, transfer: Callable[[tuple], tuple] | None = None,
                 after_stage: Callable[[tuple], None] | None = None, name: str | None = None,
                 stats: PrefetchStats | None = None):
        self.options = options
        self.stats = stats if stats is not None else PrefetchStats()  # shared: counts go on across runners
        self.name = name or options.name or "stage"
        self._source = source
        self._process_source = None
        if options.executor == "process":  # reader and stage run in a worker process
            self._process_source = ProcessSource(source, stage_fn, options.closed_exception_types,
                                                 options.ignored_exception_types, self.name)
            self._iterator, self._stage_fn = self._process_source, _prestaged_values
        else:
            self._iterator, self._stage_fn = iter(source), stage_fn
        self._transfer = transfer
        self._after_stage = after_stage  # runs on the stage values in the runner thread (async embedding pulls)
        self._cond = threading.Condition()
        self._source_lock = threading.Lock()
        self._buffer: dict[int, StagedBatch] = {}
        self._resolved_without_item: set[int] = set()  # dropped or ignored seqs
        self._errors: dict[int, BaseException] = {}
        self._pending: set[int] = set()
        self._next_seq = 0
        self._next_take = 0
        self._end_seq: float = float("inf")
        self._exhausted = False
        self._stopped = False
        self._clients_done = 0
        intra = pool.intra_op_threads if pool else 1
        self._executor = None
        if pool is not None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                pool.num_threads, thread_name_prefix=f"deeprec-{pool.name or 'stage-pool'}",
                initializer=torch.set_num_threads, initargs=(intra,))
        self._threads = [threading.Thread(target=self._run, args=(intra,), daemon=True,
                                          name=f"deeprec-{self.name}-{i}") for i in range(options.num_threads)]
        for thread in self._threads:
            thread.start()

    # -- runner side ------------------------------------------------------------------
    def _run(self, intra_op_threads: int) -> None:
        torch.set_num_threads(intra_op_threads)  # per thread: keeps the stage within its budget
        while True:
            with self._source_lock:
                with self._cond:
                    if self._stopped or self._exhausted:
                        return
                    seq = self._next_seq
                    self._next_seq += 1
                    self._pending.add(seq)
                started = time.perf_counter()
                try:
                    with record_function("deeprec.stage.read"):
                        raw = next(self._iterator)
                    if isinstance(raw, Prestaged):
                        state = raw.state
                    else:
                        state = self._source.state_dict() if hasattr(self._source, "state_dict") else None
                except BaseException as exc:  # noqa: BLE001 - classified, never swallowed
                    self._resolve_exception(seq, exc)
                    continue
                self.stats.pulled += 1
            try:
                with record_function("deeprec.stage"):
                    if self._executor is not None:
                        values = self._executor.submit(self._stage_fn, raw).result()
                    else:
                        values = self._stage_fn(raw)
                if self._after_stage is not None:
                    with record_function("deeprec.stage.after"):
                        self._after_stage(values)
                item = StagedBatch(values, seq, state)
                if self._transfer is not None:
                    with record_function("deeprec.stage.h2d"):
                        item = self._transfer(item)
            except BaseException as exc:  # noqa: BLE001
                self._resolve_exception(seq, exc)
                continue
            self._put(item, time.perf_counter() - started)

    def _resolve_exception(self, seq: int, exc: BaseException) -> None:
        with self._cond:
            self._pending.discard(seq)
            if isinstance(exc, (StopIteration, StageStreamEnd, *self.options.closed_exception_types)):
                self._end_seq = min(self._end_seq, seq)
                self._exhausted = True
            elif isinstance(exc, (StageBatchIgnored, *self.options.ignored_exception_types)):
                self.stats.ignored += 1
                self._resolved_without_item.add(seq)
                log.warning("stage %s: skipping batch %d after ignored %s: %s", self.name, seq,
                            type(exc).__name__, exc)
            else:
                self._errors[seq] = exc
                self._exhausted = True  # stop pulling; the consumer gets the error in order
            self._cond.notify_all()

    def _can_put(self, seq: int) -> bool:
        if self.options.ordered:
            return seq < self._next_take + self.options.capacity
        return len(self._buffer) < self.options.capacity

    def _put(self, item: StagedBatch, seconds: float) -> None:
        deadline = time.monotonic() + self.options.timeout_millis / 1000.0
        with self._cond:
            self.stats.stage_seconds += seconds
            while not self._stopped and not self._can_put(item.seq):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._pending.discard(item.seq)
                    self._resolved_without_item.add(item.seq)
                    self.stats.dropped += 1
                    log.warning("stage %s: dropped prefetched batch %d: no buffer space within "
                                "timeout_millis=%d", self.name, item.seq, self.options.timeout_millis)
                    self._cond.notify_all()
                    return
                self._cond.wait(min(remaining, 0.5))  # notified on every take; the poll is a safety net
            self._pending.discard(item.seq)
            if not self._stopped:
                self._buffer[item.seq] = item
                self.stats.prefetched += 1
            self._cond.notify_all()

    # -- consumer side ------------------------------------------------------------------
    def take(self) -> StagedBatch:
        """Next stage result; StopIteration at the end of the stream."""
        with self._cond:
            while True:
                if self.options.ordered:
                    while self._next_take in self._resolved_without_item:
                        self._resolved_without_item.discard(self._next_take)
                        self._next_take += 1
                        self._cond.notify_all()  # the put window moved: wake waiting runners
                    seq = self._next_take
                    if seq in self._errors:
                        raise self._fail(seq)
                    if seq >= self._end_seq:
                        raise StopIteration
                    if seq in self._buffer:
                        self._next_take += 1
                        return self._hand_out(self._buffer.pop(seq))
                else:
                    if self._buffer:
                        return self._hand_out(self._buffer.pop(min(self._buffer)))
                    if self._errors:
                        raise self._fail(min(self._errors))
                    if self._exhausted and not self._pending:
                        raise StopIteration
                if self._stopped:
                    raise RuntimeError(f"stage {self.name} was closed")
                if not any(t.is_alive() for t in self._threads):
                    raise RuntimeError(f"stage {self.name}: every runner thread exited without a result "
                                       f"for batch {self._next_take}")
                self._cond.wait(0.5)

    def _hand_out(self, item: StagedBatch) -> StagedBatch:
        self.stats.taken += 1
        self._cond.notify_all()  # a slot is free
        return item

    def _fail(self, seq: int) -> BaseException:
        self._stopped = True
        self._cond.notify_all()
        return self._errors.pop(seq)

    def drain(self) -> None:
        """Stop pulling from the source: batches already pulled are still staged and handed
        out, then take() ends with StopIteration (nothing pulled is lost). SmartStage's
        `auto` uses it to switch executors mid-stream."""
        with self._cond:
            self._exhausted = True
            self._end_seq = min(self._end_seq, self._next_seq)
            self._cond.notify_all()

    def client_finished(self) -> None:
        """A consumer is done; with all `num_clients` done the runner stops."""
        with self._cond:
            self._clients_done += 1
            last = self._clients_done >= self.options.num_clients
        if last:
            self.close()

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._buffer.clear()
            self._cond.notify_all()
        if self._process_source is not None:
            self._process_source.close()  # a runner blocked on the pipe gets EOF and exits
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join(_JOIN_SECONDS)
                if thread.is_alive():
                    log.error("stage thread %s still running after %.0fs (blocked in the reader?)",
                              thread.name, _JOIN_SECONDS)
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    @property
    def threads(self) -> list[threading.Thread]:
        return list(self._threads)
