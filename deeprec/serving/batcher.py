"""Request batching: the requests queued on a model merged into model calls, converted and scored together
in its scoring thread (or, a lone small one, on the event loop).

    HTTP / gRPC handler --Pending (shape checked)--> Batcher.queue --batch--> _score (scoring thread):
        merge_columns -> convert_columns -> model(batch) -> each request its rows of the scores
"""
from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from deeprec.data.collate import collate
from deeprec.serving import ServedModel
from deeprec.serving.request import RequestError, convert_columns, merge_columns, request_rows

_CPU = torch.device("cpu")


@dataclass
class Pending:
    """A request whose columns' shape was checked on the event loop (`request_rows`); its values are
    converted in the scoring thread, with those of the requests it is batched with: the fixed cost
    per column (about 0.7 ms for DLRM's 40) is paid once per model call, not once per request.
    `located` names an error where the client sent the value ($.instances[3].C1, $.inputs[2].data[0])."""

    columns: dict
    rows: int
    path: str
    located: Callable[[RequestError], RequestError] = lambda err: err

    @classmethod
    def checked(cls, schema, columns: dict, path: str, max_rows: int | None,
                located: Callable[[RequestError], RequestError]) -> "Pending":
        """A request whose shape `request_rows` accepts; its refusal named by `located`."""
        try:
            return cls(columns, request_rows(schema, columns, path, max_rows), path, located)
        except RequestError as err:
            raise located(err) from None

    def batch(self, model: ServedModel) -> dict:
        try:
            return convert_columns(model.schema, self.columns, self.rows, self.path)
        except RequestError as err:
            raise self.located(err) from None


def _score(model: ServedModel, items: list) -> tuple[np.ndarray | None, dict[int, Exception]]:
    """One model call for several requests (in the scoring thread: converting, merging and scoring off
    the event loop). Items are Pending requests or raw batches. Returns the scores of the items that
    converted, in order, and {index: RequestError} of those that did not: a bad value fails the
    merged conversion, the items are then converted each alone and the rest scored together."""
    if all(isinstance(item, Pending) for item in items) and len(items) > 1:
        merged = merge_columns([(item.columns, item.rows) for item in items])
        if merged is not None:
            try:
                batch = convert_columns(model.schema, merged, sum(item.rows for item in items))
            except RequestError:
                pass  # one of them holds a bad value: found below
            else:
                return model(batch).numpy(), {}
    batches, refused = [], {}
    for k, item in enumerate(items):
        try:
            batches.append(item.batch(model) if isinstance(item, Pending) else item)
        except RequestError as err:
            refused[k] = err
    if not batches:
        return None, refused
    return model(collate(batches) if len(batches) > 1 else batches[0]).numpy(), refused


class Batcher:
    """Merges concurrent requests into model calls, waiting on no clock. A batch is every request that
    queued while the previous one scored, plus those the server is reading and converting right now
    (`arriving()`: they are on the event loop already), and as many as were in flight together since
    the last batch formed (the clients likely to call again: gRPC's calls reach the loop a few turns
    apart, unseen until decoded; 8 gRPC clients of 1 row: 1.7 -> 3.2-5 rows per model call), up to
    `max_batch` rows. A lone request is scored at once, a small one on the event loop. `max_wait_s`
    (--max-wait-ms, default 0) waits that much longer for company."""

    TURNS, MAX_TURNS = 4, 64  # event-loop turns a batch gives the requests arriving (no clock: an idle
    # loop turns in microseconds), then more while some are being read, up to MAX_TURNS
    INLINE_ROWS = 16  # a lone request of at most this many rows is scored on the event loop itself (a
    # fraction of a ms); a larger one, or one with company, goes to the scoring thread

    def __init__(self, model: ServedModel, rows_metric, max_batch: int, max_wait_s: float):
        self.model, self.rows_metric = model, rows_metric
        self.max_batch, self.max_wait_s = max_batch, max_wait_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.scorer = ThreadPoolExecutor(1, thread_name_prefix="deeprec-score")
        self.task: asyncio.Task | None = None
        self.reading = 0
        self.in_flight = self.company = 0  # requests submitted and not answered; the most of them at once
        # since the last batch formed: the clients that will likely ask again (gRPC's calls reach the loop
        # one by one, a few turns apart, unseen before they are decoded: `reading` cannot count them)

    @contextlib.contextmanager
    def arriving(self):
        """Around reading and converting a request: the batch being formed waits for it (measured on 2
        cores, 8 clients of 1 row: 7.5 rows per model call instead of 2.6, 2.1 CPU-ms per request
        instead of 3.4)."""
        self.reading += 1
        try:
            yield
        finally:
            self.reading -= 1

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def submit(self, batch: dict, rows: int) -> tuple[np.ndarray, ServedModel]:
        future = asyncio.get_running_loop().create_future()
        self.in_flight += 1
        self.company = max(self.company, self.in_flight)
        try:
            await self.queue.put((batch, rows, future))
            return await future
        finally:  # when its handler resumes: a batch forming before that counts it, as its client is
            self.in_flight -= 1  # about to ask again (counted out at the answer: 8 gRPC clients x 1 row
            # 1,204 -> 952 rows/s, one alternating run)

    @staticmethod
    def _settle(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
        """Answer a request; one cancelled (its client gone) is skipped."""
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            pending = [await self.queue.get()]
            rows = pending[0][1]
            turns, expected, self.company = 0, self.company, self.in_flight
            while True:
                while rows < self.max_batch and not self.queue.empty():
                    pending.append(self.queue.get_nowait())
                    rows += pending[-1][1]
                if (rows >= self.max_batch or turns == self.MAX_TURNS
                        or turns >= self.TURNS and not self.reading and len(pending) >= expected):
                    break
                await asyncio.sleep(0)  # one turn of the event loop: the requests being read go on
                turns += 1
            deadline = loop.time() + self.max_wait_s
            while rows < self.max_batch and self.max_wait_s > 0:
                try:
                    item = await asyncio.wait_for(self.queue.get(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    break
                pending.append(item)
                rows += item[1]
            model = self.model  # one model per batch: an update swaps it between batches
            items = [b for b, _, _ in pending]
            try:
                if len(pending) == 1 and self._inline(model, rows):
                    scores, refused = _score(model, items)  # alone and small: no hop to the scoring thread
                else:
                    scores, refused = await loop.run_in_executor(self.scorer, _score, model, items)
            except Exception as err:  # the model call failed: each request alone, one must not fail the others
                if len(pending) == 1:
                    self._settle(pending[0][2], error=err)
                    continue
                for item, n, future in pending:
                    try:
                        scores, refused = await loop.run_in_executor(self.scorer, _score, model, [item])
                        self._answer([(item, n, future)], scores, refused, model)
                    except Exception as alone:
                        self._settle(future, error=alone)
                continue
            self._answer(pending, scores, refused, model)

    def _inline(self, model, rows: int) -> bool:
        """Score on the event loop: a small lone request, nobody else arriving, a compiled CPU package
        (a fraction of a ms; the traced program or a GPU would stall every connection meanwhile)."""
        return (rows <= self.INLINE_ROWS and not self.reading and self.queue.empty()
                and getattr(model, "compiled", None) is not None and getattr(model, "device", None) == _CPU)

    def _answer(self, pending: list, scores, refused: dict, model) -> None:
        """Each request its rows of `scores` (those of the requests not refused, in order), or its error."""
        scored = sum(n for k, (_, n, _) in enumerate(pending) if k not in refused)
        if scored:
            self.rows_metric.observe(scored)
        start = 0
        for k, (_, n, future) in enumerate(pending):
            if k in refused:
                self._settle(future, error=refused[k])
                continue
            self._settle(future, (scores[start:start + n], model))
            start += n
