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
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from deeprec.data.collate import batch_rows
from deeprec.serving import ServedModel, ServingError
from deeprec.serving.batcher import Batcher, Pending
from deeprec.serving.export import MANIFEST
from deeprec.serving.online import ExportFolder

log = logging.getLogger("deeprec.serve")
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
