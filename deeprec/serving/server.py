"""`deeprec serve MODEL_DIR`: an HTTP JSON inference server with dynamic batching.

    POST /v1/predict  {"inputs": {"column": [value per row], ...}}  ->  {"scores": [...], "step": N}
    GET  /healthz     {"status": "ok", "step": N}
    GET  /metrics     Prometheus text: requests by code, latency histogram, batch rows, model step

    request ──validate (400 naming the field)──> queue ──batcher: up to max_batch rows or max_wait──>
        one model call in the scoring thread ──> each request's slice of the scores

Starlette + uvicorn (ASGI): a small, well-kept stack (FastAPI is built on it); the model runs
in one background thread so the event loop keeps accepting requests while a batch scores.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import uvicorn
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deeprec.data.collate import collate
from deeprec.serving import RequestError, ServedModel, batch_rows, load
from deeprec.serving.export import MANIFEST
from deeprec.serving.online import ExportFolder

log = logging.getLogger("deeprec.serve")


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("deeprec_requests", "predict requests by HTTP status", ["code"],
                                registry=self.registry)
        self.latency = Histogram("deeprec_request_latency_seconds", "predict request latency",
                                 buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5),
                                 registry=self.registry)
        self.batch_rows = Histogram("deeprec_batch_rows", "rows per model call (dynamic batching)",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
                                    registry=self.registry)
        self.step = Gauge("deeprec_model_step", "training step of the model served", registry=self.registry)
        self.updates = Counter("deeprec_model_updates", "online updates applied (deltas or full exports)",
                               registry=self.registry)
        self.update_errors = Counter("deeprec_model_update_errors", "online updates that failed (the model "
                                     "served stays as it was; the error is logged)", registry=self.registry)


class Batcher:
    """Merges concurrent requests into model calls of at most `max_batch` rows, waiting at most
    `max_wait_s` for more once the first request of a batch has arrived."""

    def __init__(self, model: ServedModel, metrics: Metrics, max_batch: int, max_wait_s: float):
        self.model, self.metrics = model, metrics
        self.max_batch, self.max_wait_s = max_batch, max_wait_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.scorer = ThreadPoolExecutor(1, thread_name_prefix="deeprec-score")
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def submit(self, batch: dict, rows: int) -> tuple[torch.Tensor, ServedModel]:
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((batch, rows, future))
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            pending = [await self.queue.get()]
            rows = pending[0][1]
            deadline = loop.time() + self.max_wait_s
            while rows < self.max_batch:
                try:
                    item = await asyncio.wait_for(self.queue.get(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    break
                pending.append(item)
                rows += item[1]
            try:
                model = self.model  # one model per batch: an update swaps it between batches
                merged = collate([b for b, _, _ in pending]) if len(pending) > 1 else pending[0][0]
                scores = await loop.run_in_executor(self.scorer, model, merged)
                self.metrics.batch_rows.observe(rows)
                start = 0
                for _, n, future in pending:
                    future.set_result((scores[start:start + n], model))
                    start += n
            except Exception as err:  # every waiting request learns of it; the batcher goes on
                for _, _, future in pending:
                    if not future.done():
                        future.set_exception(err)


def make_app(model: ServedModel, max_batch: int = 256, max_wait_ms: float = 2.0, folder=None,
             watch_interval_s: float = 1.0) -> Starlette:
    """`folder` (an ExportFolder): new deltas and full exports in it are applied while serving."""
    metrics = Metrics()
    metrics.step.set(model.step)
    batcher = Batcher(model, metrics, max_batch, max_wait_ms / 1000)

    async def watch() -> None:
        loop, loader = asyncio.get_running_loop(), ThreadPoolExecutor(1, thread_name_prefix="deeprec-update")
        while True:
            await asyncio.sleep(watch_interval_s)
            try:
                newer = await loop.run_in_executor(loader, folder.refresh, batcher.model)
            except Exception as err:  # a bad delta: logged and counted; the model served stays whole
                metrics.update_errors.inc()
                log.error("online update failed, still serving step %d: %s", batcher.model.step, err)
                continue
            if newer is not None:  # swapped between two batches: a batch reads batcher.model once
                batcher.model = newer
                metrics.step.set(newer.step)
                metrics.updates.inc()

    async def predict(request: Request) -> JSONResponse:
        started = time.perf_counter()
        try:
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError) as err:
                raise RequestError(f"the body is not JSON ({err})") from None
            if not isinstance(body, dict) or not isinstance(body.get("inputs"), dict):
                raise RequestError("the body must be {\"inputs\": {\"column\": [value per row], ...}}")
            model = batcher.model
            batch = model.batch(body["inputs"])
            scores, served = await batcher.submit(batch, batch_rows(batch))
            code, payload = 200, {"scores": _scores(scores, served.labels), "step": served.step}
        except RequestError as err:
            code, payload = 400, {"error": str(err)}
        metrics.requests.labels(code=str(code)).inc()
        metrics.latency.observe(time.perf_counter() - started)
        return JSONResponse(payload, status_code=code)

    async def healthz(request: Request) -> JSONResponse:
        model = batcher.model
        return JSONResponse({"status": "ok", "step": model.step, "model": model.manifest["model"]})

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher.start()
        watcher = asyncio.get_running_loop().create_task(watch()) if folder is not None else None
        yield
        if watcher is not None:
            watcher.cancel()
        batcher.task.cancel()
        batcher.scorer.shutdown(wait=True)

    app = Starlette(routes=[Route("/v1/predict", predict, methods=["POST"]), Route("/healthz", healthz),
                            Route("/metrics", prometheus)], lifespan=lifespan)
    app.state.metrics = metrics
    return app


def _scores(scores: torch.Tensor, labels: list[str]):
    if scores.dim() == 1:
        return scores.tolist()
    return {name: scores[:, k].tolist() for k, name in enumerate(labels)}


def serve(path: str, host: str = "127.0.0.1", port: int = 8080, max_batch: int = 256,
          max_wait_ms: float = 2.0, threads: int | None = None, watch_interval_s: float = 1.0) -> None:
    """Serve the export at `path` until interrupted; prints `listening on http://host:port` when ready.
    `threads`: torch intra-op threads of the scoring thread (default: cores - 1, leaving one core to the
    event loop that parses requests: background + intra-op <= cores)."""
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) - 1))
    folder = None if os.path.exists(os.path.join(path, MANIFEST)) else ExportFolder(path)  # a training's export dir
    app = make_app(load(path), max_batch, max_wait_ms, folder, watch_interval_s)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it: no Nagle delay
    sock.bind((host, port))
    sock.listen(1024)  # connections wait in the backlog until uvicorn accepts
    print(f"listening on http://{host}:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
