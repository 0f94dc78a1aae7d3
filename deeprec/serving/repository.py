"""The models `deeprec serve PATH` serves: one export, one training's export dir, or a model repository,
each with its batcher, scoring thread, health, metrics and online-update watcher.

    PATH/manifest.json                   one export, served under its folder's name (--model-name)
    PATH/full-<step>/, delta-<step>.*    a training's --export-dir, followed while serving (online),
                                         served under the export dir's name (--model-name)
    PATH/<name>/...                      a model repository, as Triton's: each folder one of the two
                                         above, served as <name> (letters, digits, _ . -)

Folders whose name starts with "." are skipped (an export being written stages in `.export-*`).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from deeprec.data.collate import batch_rows, collate
from deeprec.serving import ServedModel, ServingError
from deeprec.serving.export import MANIFEST
from deeprec.serving.online import ExportFolder
from deeprec.serving.request import RequestError, convert_columns, merge_columns, request_rows

log = logging.getLogger("deeprec.serve")
_CPU = torch.device("cpu")
NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_ONLINE = re.compile(r"^(full-\d+|delta-\d+\.json)$")


def is_export(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def is_export_dir(path: str) -> bool:
    """A training's --export-dir: it holds a full export or a delta (full-<step>/, delta-<step>.json)."""
    return os.path.isdir(path) and any(_ONLINE.match(name) for name in os.listdir(path))


def open_model(path: str) -> tuple[ServedModel, ExportFolder | None]:
    """The model at `path` (an export or a training's export dir) and the folder to follow, if any.
    An export dir is lenient: bad exports and deltas refused, the last good one served."""
    if is_export(path):
        return ServedModel(path), None
    folder = ExportFolder(path, lenient=True, check=lambda m: m.probe())
    return folder.load(), folder


def model_name(path: str, given: str | None = None) -> str:
    """The name a single export (or export dir) at `path` is served under, in every URL and metadata
    answer: `given` (--model-name), else the folder's name, as Triton names a model by its folder
    (never a file path: a custom model's manifest names it by module:attribute, which no URL holds)."""
    name = given if given is not None else os.path.basename(os.path.normpath(os.path.abspath(path)))
    if not NAME.fullmatch(name) or not name.strip("."):  # "." and "..": clients normalize them away
        where = "--model-name" if given is not None else f"{path}: the folder's name"
        raise ServingError(f"{where} {name!r} cannot be a model's name in URLs: letters, digits, _ . - only"
                           + ("" if given is not None else "; give --model-name"))
    return name


def open_repository(path: str, name: str | None = None) -> tuple[dict[str, tuple[ServedModel, ExportFolder | None]],
                                                                 bool]:
    """({name: (model, folder)}, is a repository). One export or export dir is one model named by
    model_name(path, name); a repository's models are named by their folders (`name`: refused). A
    folder that is neither: ServingError."""
    if is_export(path) or is_export_dir(path):
        served_as = model_name(path, name)
        return {served_as: open_model(path)}, False
    if not os.path.isdir(path):
        raise ServingError(f"{path}: no such export")
    if name is not None:
        raise ServingError(f"--model-name {name}: {path} is a model repository, whose models are named by their "
                           "folders; --model-name names a single export")
    names = sorted(n for n in os.listdir(path) if not n.startswith(".") and os.path.isdir(os.path.join(path, n)))
    if not names:
        raise ServingError(f"{path}: no export: neither an export (manifest.json), a training's export dir "
                           "(full-<step>/) nor a model repository (one of those per model folder)")
    models = {}
    for name in names:
        sub = os.path.join(path, name)
        if not NAME.fullmatch(name):
            raise ServingError(f"{sub}: a model's folder name is its name in URLs: letters, digits, _ . - only")
        if not (is_export(sub) or is_export_dir(sub)):
            raise ServingError(f"{sub}: neither an export (manifest.json) nor a training's export dir "
                               "(full-<step>/): each folder of a model repository is one of those")
        models[name] = open_model(sub)
    return models, True


class Metrics:
    """The server's Prometheus metrics; serving a repository, each has a `model` label. `exposed`: the
    registry /metrics answers with: `registry`'s, or in a worker of `deeprec serve --workers N`
    (serving.workers) every worker's, read from the supervisor's PROMETHEUS_MULTIPROC_DIR: counters
    and histograms summed over the workers (dead ones' counts kept), the step and readiness gauges
    the least of the live workers' (the step every worker serves; 1 if every worker is ready)."""

    def __init__(self, labelled: bool):
        from deeprec.serving import workers

        self.registry, self.labelled = CollectorRegistry(), labelled
        self.exposed = self.registry
        if workers.current() is not None:
            from prometheus_client.multiprocess import MultiProcessCollector

            self.exposed = CollectorRegistry()
            MultiProcessCollector(self.exposed)
        model = ["model"] if labelled else []
        r = self.registry
        self.requests = Counter("deeprec_requests", "predict requests by HTTP status", [*model, "code"], registry=r)
        self.latency = Histogram("deeprec_request_latency_seconds", "predict request latency", model, registry=r,
                                 buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5))
        self.batch_rows = Histogram("deeprec_batch_rows", "rows per model call (dynamic batching)", model,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096), registry=r)
        self.step = Gauge("deeprec_model_step", "training step of the model served", model, registry=r,
                          multiprocess_mode="livemin")
        self.updates = Counter("deeprec_model_updates", "online updates applied (deltas or full exports)", model,
                               registry=r)
        self.update_errors = Counter("deeprec_model_update_errors", "online updates that failed (the model "
                                     "served stays as it was; the error is logged)", model, registry=r)
        self.updates_refused = Counter("deeprec_model_updates_refused", "deltas or full exports refused (corrupt, "
                                       "non-finite values, a failed probe prediction); never retried, the "
                                       "model served stays as it was", model, registry=r)
        self.update_checks = Counter("deeprec_model_update_checks", "looks at the export folder for a newer "
                                     "model (the watcher is alive: it grows every --watch-interval)", model,
                                     registry=r)
        self.ready = Gauge("deeprec_model_ready", "1 if the model served answers a probe prediction", model,
                           registry=r, multiprocess_mode="livemin")

    def of(self, metric, name: str):
        """`metric`'s series for the model `name`."""
        return metric.labels(model=name) if self.labelled else metric

    def count(self, name: str | None, code: int) -> None:
        """A request answered; `name` None: no model matched (model="" when labelled)."""
        labels = {"model": name or ""} if self.labelled else {}
        self.requests.labels(code=str(code), **labels).inc()


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
    apart, unseen until decoded; 8 gRPC clients of 1 row: 1.7 -> 4 rows per model call), up to
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
        finally:
            self.in_flight -= 1

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
                    if not pending[0][2].done():
                        pending[0][2].set_exception(err)
                    continue
                for item, n, future in pending:
                    try:
                        scores, refused = await loop.run_in_executor(self.scorer, _score, model, [item])
                        self._answer([(item, n, future)], scores, refused, model)
                    except Exception as alone:
                        if not future.done():
                            future.set_exception(alone)
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
                if not future.done():
                    future.set_exception(refused[k])
                continue
            if not future.done():  # a request cancelled (its client gone) is skipped
                future.set_result((scores[start:start + n], model))
            start += n


class NonFinite(Exception):
    """The model gave a NaN or an infinity: the server's fault (the request's values were checked)."""


class Missing(Exception):
    """No such model (404), or no model named where several are served (400)."""

    def __init__(self, message: str, status: int = 404):
        super().__init__(message)
        self.status = status


def find_served(served: dict, name: str, version: str | None = None) -> "Served":
    """The model `name` of `served` (at `version`, the training step of its export, if one is given)."""
    found = served.get(name)
    if found is None:
        raise Missing(f"no model {name!r} here (serving: {', '.join(served)})")
    if version is not None and version != str(found.model.step):
        raise Missing(f"model {name!r} version {version!r} is not served: version {found.model.step} is "
                      "(the version is the training step of the export served)")
    return found


class Served:
    """One model served: its batcher, health (a probe prediction at start and before each update is
    taken) and the export folder it follows, if any."""

    def __init__(self, name: str, model: ServedModel, folder, metrics: Metrics, max_batch: int,
                 max_wait_s: float, watch_interval_s: float):
        self.name, self.folder, self.metrics, self.watch_interval_s = name, folder, metrics, watch_interval_s
        self.latency, self.step = metrics.of(metrics.latency, name), metrics.of(metrics.step, name)
        self.ready, self.updates = metrics.of(metrics.ready, name), metrics.of(metrics.updates, name)
        self.batcher = Batcher(model, metrics.of(metrics.batch_rows, name), max_batch, max_wait_s)
        self.step.set(model.step)
        self.not_ready, self.refused_seen = model.probe(), 0
        self.ready.set(self.not_ready is None)
        if self.not_ready:
            log.error("model %s (step %d) cannot answer: %s", name, model.step, self.not_ready)
        self.note_refusals()  # those refused while loading the model served

    @property
    def model(self) -> ServedModel:
        return self.batcher.model

    def note_refusals(self) -> None:
        if self.folder is None:
            return
        for _, why in list(self.folder.refused.items())[self.refused_seen:]:
            self.metrics.of(self.metrics.updates_refused, self.name).inc()
            log.error("online update refused, model %s still serving step %d: %s", self.name, self.model.step, why)
        self.refused_seen = len(self.folder.refused)

    async def watch(self) -> None:
        loop, loader = asyncio.get_running_loop(), ThreadPoolExecutor(1, thread_name_prefix="deeprec-update")
        while True:
            await asyncio.sleep(self.watch_interval_s)
            try:
                newer = await loop.run_in_executor(loader, self.folder.refresh, self.model)
            except Exception as err:  # I/O and the like: logged, counted and tried again; the model stays whole
                self.metrics.of(self.metrics.update_errors, self.name).inc()
                log.error("online update failed, model %s still serving step %d: %s", self.name, self.model.step, err)
                continue
            finally:
                self.note_refusals()
                self.metrics.of(self.metrics.update_checks, self.name).inc()
            if newer is not None:  # swapped between two batches: a batch reads batcher.model once
                self.batcher.model = newer
                self.step.set(newer.step)
                self.updates.inc()
                self.not_ready = None  # the folder probed it (check=ServedModel.probe)
                self.ready.set(1)

    async def score(self, request: Pending | dict) -> tuple[np.ndarray, ServedModel]:
        """Scores of a Pending request (a RequestError if one of its values does not fit), or of a raw batch."""
        rows = request.rows if isinstance(request, Pending) else batch_rows(request)
        scores, model = await self.batcher.submit(request, rows)
        if not np.isfinite(scores).all():  # never the client's fault: its values were checked
            log.error("model %s (step %d) gave non-finite scores to a request", self.name, model.step)
            raise NonFinite
        return scores, model

    def health(self) -> dict:
        payload = {"status": "ok" if self.not_ready is None else "not ready", "step": self.model.step,
                   "model": self.model.manifest["model"]}
        if self.not_ready is not None:
            payload["reason"] = self.not_ready
        if self.folder is not None and self.folder.refused:
            last = next(reversed(self.folder.refused))
            payload["refused_updates"] = len(self.folder.refused)
            payload["last_refused"] = {"path": last, "reason": self.folder.refused[last]}
        return payload
