"""SmartStage `executor="auto"`: measure the stage and the step, then pick how to run them.

    batches 1..W       inline, all intra-op threads:   read+stage S and step M(c), timed apart
    batches W+1..2W    inline, one thread fewer:       step M(c-1)
    predict            off = S + M(c);   thread = max(S, M(c-1))
    trial              the thread executor for T batches, where predicted >= 5% faster than off;
                       kept only if its measured time per batch beats off's. If the thread lost
                       much more than predicted (the stage holding the GIL), the process executor
                       is tried the same way (readers that can resume: BatchReader).
    the rest           the choice; a drained runner hands out every batch it pulled first, so no
                       batch is lost or repeated across switches.

The training math does not depend on the choice (only the intra-op thread count may
change float rounding). `fast.auto_decision` keeps the measurements and the reason.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from deeprec.runtime.hook import PrefetchHook
from deeprec.runtime.prefetch import PrefetchStats

W, T = 8, 12  # batches per inline phase and per trial; the first few of each are warm-up
WARM = 2
TRY_BELOW = 0.95  # try the thread executor where predicted below this share of off's time
KEEP_BELOW = 0.97  # keep a tried executor where measured below this share of the best so far
GIL_EXCESS = 1.15  # the thread measured this far above its prediction: try the process executor


@dataclasses.dataclass
class AutoDecision:
    executor: str = "pending"  # off | thread | process
    main_threads: int = 0
    reason: str = ""
    ms: dict = dataclasses.field(default_factory=dict)  # stage, step_all, step_fewer, off, thread[, process]

    def summary(self) -> str:
        shown = ", ".join(f"{k} {v:.2f} ms" for k, v in self.ms.items())
        return f"SmartStage auto picked {self.executor} (step on {self.main_threads} threads): {self.reason}; {shown}"


class _Continue:
    """The rest of a reader's stream: iterating continues one iterator; positions are the reader's."""

    def __init__(self, reader, iterator):
        self.reader, self.iterator = reader, iterator

    def __iter__(self):
        return self.iterator

    def state_dict(self):
        return self.reader.state_dict() if hasattr(self.reader, "state_dict") else None


def _median_ms(values: list[float]) -> float:
    kept = values[WARM:] if len(values) > WARM + 1 else values
    return 1e3 * statistics.median(kept) if kept else float("nan")


def run_auto(fast, reader, step, before_step=None):
    """Yields (outputs, reader position after the batch) for every batch of `reader`."""
    decision = fast.auto_decision = AutoDecision()
    cores = torch.get_num_threads()
    fewer = fast.config.main_threads or max(1, cores - 1)
    saved_threads = cores
    phase = {"name": "calibration", "mode": "off", "threads": cores}  # where a run that stops early ended
    iterator = iter(reader)
    stage_s, step_all, step_fewer = [], [], []
    stats = fast.prefetch_stats = PrefetchStats()  # every phase counts here: --log-dir's time/stage_ms inline too

    def inline(count: int, threads: int, steps: list):
        torch.set_num_threads(threads)
        phase.update(mode="off", threads=threads)
        for _ in range(count):
            t0 = time.perf_counter()
            try:
                raw = next(iterator)
            except StopIteration:
                return
            state = reader.state_dict() if hasattr(reader, "state_dict") else None
            item = fast.stage(raw)
            t1 = time.perf_counter()
            stats.pulled, stats.prefetched, stats.taken = stats.pulled + 1, stats.prefetched + 1, stats.taken + 1
            stats.stage_seconds += t1 - t0
            if before_step is not None:
                before_step()
            out = step(item)
            stage_s.append(t1 - t0)
            steps.append(time.perf_counter() - t1)
            yield out, state

    def staged(source, executor: str, threads: int, limit: int | None, walls: list):
        """Batches through a prefetch runner; after `limit` batches the runner is drained."""
        options = dataclasses.replace(fast.config.smart_stage_options, executor=executor)
        phase.update(name=f"{executor} trial" if limit is not None else phase["name"], mode=executor, threads=threads)
        last_state = None
        with PrefetchHook(fast, source, options=options, main_threads=threads, stats=stats) as hook:
            batches = iter(hook)
            started = time.perf_counter()
            for n, item in enumerate(batches, 1):
                if limit is not None and n == limit:
                    hook.runner.drain()
                if before_step is not None:
                    before_step()
                out = step(item)
                now = time.perf_counter()
                walls.append(now - started)
                started = now
                last_state = item.source_state
                yield out, item.source_state
        return last_state

    try:
        yield from inline(W, cores, step_all)
        yield from inline(W, fewer, step_fewer)
        if len(step_fewer) < W:
            decision.executor, decision.main_threads = "off", cores
            decision.reason = "the stream ended during calibration"
            return
        s, m_all, m_fewer = _median_ms(stage_s), _median_ms(step_all), _median_ms(step_fewer)
        off, predicted = s + m_all, max(s, m_fewer)
        decision.ms = {"stage": s, "step_all": m_all, "step_fewer": m_fewer, "off": off}
        choice, threads = "off", cores
        if predicted < TRY_BELOW * off:
            walls: list[float] = []
            yield from staged(_Continue(reader, iterator), "thread", fewer, T, walls)
            decision.ms["thread"] = measured = _median_ms(walls)
            if measured < KEEP_BELOW * off:
                choice, threads = "thread", fewer
            if measured > GIL_EXCESS * predicted and hasattr(reader, "load_state_dict") and \
                    hasattr(reader, "state_dict"):
                walls = []
                last = yield from staged(reader, "process", fewer, T, walls)
                decision.ms["process"] = process = _median_ms(walls)
                if last is not None:
                    reader.load_state_dict(last)  # the worker read ahead: resume after the last batch trained on
                iterator = iter(reader)
                if process < KEEP_BELOW * min(off, measured):
                    choice = "process"
        decision.executor, decision.main_threads = choice, threads
        tried = [f"{k} measured {decision.ms[k]:.2f} ms" for k in ("thread", "process") if k in decision.ms]
        decision.reason = {
            "off": (f"tried {' and '.join(tried)} per batch: no faster than {off:.2f} ms inline" if tried else
                    f"staging ahead on {fewer} step threads would not pay (predicted {predicted:.2f} ms vs "
                    f"{off:.2f} ms per batch inline)"),
            "thread": "the stage overlaps the step in a thread (its ops release the GIL)",
            "process": "the stage holds the GIL: a worker process overlaps it with the step",
        }[choice]
        phase["name"] = "run"
        if choice == "off":
            yield from inline(1 << 62, cores, [])
        else:
            source = _Continue(reader, iterator) if choice == "thread" else reader
            yield from staged(source, choice, threads, None, [])
    finally:
        torch.set_num_threads(saved_threads)
        if decision.executor == "pending":  # the loop stopped before auto decided
            decision.executor, decision.main_threads = phase["mode"], phase["threads"]
            decision.reason = f"the run ended during the {phase['name']}, before a choice (ran {phase['mode']})"
