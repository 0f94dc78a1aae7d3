"""`deeprec serve MODEL_DIR`: an HTTP JSON inference server with dynamic batching.

    POST /v1/predict  {"inputs": {"column": [value per row], ...}}  ->  {"scores": [...], "step": N}
    GET  /healthz     {"status": "ok", "step": N, "model": NAME}  (503 {"status": "not ready", ...})
    GET  /metrics     Prometheus text: requests by code, latency histogram, batch rows, model step

    request ──token? (401)──body <= max_body_bytes? (413)──decode + validate (400 "$.json.path: why")──>
        queue ──batcher: up to max_batch rows or max_wait──> one model call in the scoring thread
        ──> each request's slice of the scores (checked finite before they are written)

A client's mistake is a 4xx naming it; a 5xx is the server's own fault (logged with its traceback).

Starlette + uvicorn (ASGI): a small, well-kept stack (FastAPI is built on it); the model runs
in one background thread so the event loop keeps accepting requests while a batch scores.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import torch
import uvicorn
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deeprec.data.collate import collate
from deeprec.errors import ConfigError
from deeprec.serving import RequestError, ServedModel, ServingError, batch_rows
from deeprec.serving.export import MANIFEST
from deeprec.serving.online import ExportFolder

MAX_BODY_BYTES = 8 << 20  # --max-body-bytes: a larger body is a 413, read no further
MAX_ROWS = 8192  # --max-rows: rows of one request

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
        self.updates_refused = Counter("deeprec_model_updates_refused", "deltas or full exports refused (corrupt, "
                                       "non-finite values, a failed probe prediction); never retried, the "
                                       "model served stays as it was", registry=self.registry)
        self.ready = Gauge("deeprec_model_ready", "1 if the model served answers a probe prediction",
                           registry=self.registry)


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
            model = self.model  # one model per batch: an update swaps it between batches
            try:
                merged = collate([b for b, _, _ in pending]) if len(pending) > 1 else pending[0][0]
                scores = await loop.run_in_executor(self.scorer, model, merged)
                self.metrics.batch_rows.observe(rows)
                start = 0
                for _, n, future in pending:
                    if not future.done():  # a request cancelled (its client gone) is skipped
                        future.set_result((scores[start:start + n], model))
                    start += n
            except Exception as err:
                if len(pending) == 1:  # the request learns of it; the batcher goes on
                    if not pending[0][2].done():
                        pending[0][2].set_exception(err)
                    continue
                for batch, n, future in pending:  # one request must not fail the others: each alone
                    try:
                        scores = await loop.run_in_executor(self.scorer, model, batch)
                        self.metrics.batch_rows.observe(n)
                        if not future.done():
                            future.set_result((scores, model))
                    except Exception as alone:
                        if not future.done():
                            future.set_exception(alone)


class _TooLarge(Exception):
    pass


def make_app(model: ServedModel, max_batch: int = 256, max_wait_ms: float = 2.0, folder=None,
             watch_interval_s: float = 1.0, *, max_rows: int = MAX_ROWS, max_body_bytes: int = MAX_BODY_BYTES,
             token: str | None = None) -> Starlette:
    """`folder` (an ExportFolder): new deltas and full exports in it are applied while serving (a bad
    one is refused, counted and named in /healthz). `token`: /v1/predict requires
    `Authorization: Bearer <token>`."""
    metrics = Metrics()
    metrics.step.set(model.step)
    batcher = Batcher(model, metrics, max_batch, max_wait_ms / 1000)
    health = {"not_ready": model.probe(), "refused": 0}
    metrics.ready.set(health["not_ready"] is None)
    if health["not_ready"]:
        log.error("the model served (step %d) cannot answer: %s", model.step, health["not_ready"])
    expected = f"Bearer {token}".encode() if token else None
    decoder = msgspec.json.Decoder()

    def note_refusals() -> None:
        if folder is None:
            return
        for path, why in list(folder.refused.items())[health["refused"]:]:
            metrics.updates_refused.inc()
            log.error("online update refused, still serving step %d: %s", batcher.model.step, why)
        health["refused"] = len(folder.refused)

    note_refusals()  # those refused while loading the model served

    async def watch() -> None:
        loop, loader = asyncio.get_running_loop(), ThreadPoolExecutor(1, thread_name_prefix="deeprec-update")
        while True:
            await asyncio.sleep(watch_interval_s)
            try:
                newer = await loop.run_in_executor(loader, folder.refresh, batcher.model)
            except Exception as err:  # I/O and the like: logged, counted and tried again; the model stays whole
                metrics.update_errors.inc()
                log.error("online update failed, still serving step %d: %s", batcher.model.step, err)
                continue
            finally:
                note_refusals()
            if newer is not None:  # swapped between two batches: a batch reads batcher.model once
                batcher.model = newer
                metrics.step.set(newer.step)
                metrics.updates.inc()
                health["not_ready"] = None  # the folder probed it (check=ServedModel.probe)
                metrics.ready.set(1)

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise _TooLarge(int(declared))
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise _TooLarge(size)
            chunks.append(chunk)
        return b"".join(chunks)

    def decode(body: bytes):
        try:
            return decoder.decode(body)
        except RecursionError:
            raise RequestError("the body nests deeper than any request may (a request is "
                               "{\"inputs\": {\"column\": [value per row]}}, a sequence value one list deeper)") from None
        except msgspec.DecodeError as err:
            try:  # NaN, Infinity (Python's JSON): NaN is a missing value; an infinity is named at its path
                return json.loads(body)
            except RecursionError:
                raise RequestError("the body nests deeper than any request may") from None
            except (ValueError, UnicodeDecodeError):
                raise RequestError(f"the body is not JSON ({err})") from None

    async def predict(request: Request) -> JSONResponse:
        started = time.perf_counter()
        try:
            if expected is not None and not hmac.compare_digest(
                    request.headers.get("authorization", "").encode("latin-1", "replace"), expected):
                response = JSONResponse({"error": "a bearer token is required: Authorization: Bearer <token>"},
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
            else:
                response = await answer(request)
        except _TooLarge as err:
            response = JSONResponse({"error": f"the body is over {max_body_bytes} bytes (--max-body-bytes): "
                                              f"{err.args[0]}{'+' if request.headers.get('content-length') is None else ''} "
                                              f"bytes; split the request"}, status_code=413)
        except Exception:  # a bug of the server, never the client's: logged with its traceback
            log.exception("predict failed")
            response = JSONResponse({"error": "internal error (logged by the server)"}, status_code=500)
        metrics.requests.labels(code=str(response.status_code)).inc()  # as sent
        metrics.latency.observe(time.perf_counter() - started)
        return response

    async def answer(request: Request) -> JSONResponse:
        try:
            body = decode(await read_body(request))
            if not isinstance(body, dict) or not isinstance(body.get("inputs"), dict):
                raise RequestError("the body must be {\"inputs\": {\"column\": [value per row], ...}}")
            model = batcher.model
            batch = model.batch(body["inputs"], "$.inputs", max_rows)
        except RequestError as err:
            return JSONResponse({"error": str(err), "path": err.path}, status_code=400)
        if health["not_ready"] is not None:
            return JSONResponse({"error": f"the model served cannot answer: {health['not_ready']}"}, status_code=503)
        scores, served = await batcher.submit(batch, batch_rows(batch))
        if not bool(torch.isfinite(scores).all()):  # never the client's fault: its values were checked
            log.error("the model served (step %d) gave non-finite scores to a request", served.step)
            return JSONResponse({"error": "the model gave non-finite scores (logged by the server)"}, status_code=500)
        return JSONResponse({"scores": _scores(scores, served.labels), "step": served.step})

    async def healthz(request: Request) -> JSONResponse:
        model = batcher.model
        payload = {"status": "ok" if health["not_ready"] is None else "not ready", "step": model.step,
                   "model": model.manifest["model"]}
        if health["not_ready"] is not None:
            payload["reason"] = health["not_ready"]
        if folder is not None and folder.refused:
            last = next(reversed(folder.refused))
            payload["refused_updates"] = len(folder.refused)
            payload["last_refused"] = {"path": last, "reason": folder.refused[last]}
        return JSONResponse(payload, status_code=200 if health["not_ready"] is None else 503)
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
          max_wait_ms: float = 2.0, threads: int | None = None, watch_interval_s: float = 1.0, *,
          max_rows: int = MAX_ROWS, max_body_bytes: int = MAX_BODY_BYTES, token: str | None = None) -> None:
    """Serve the export at `path` until interrupted; prints `listening on http://host:port` when ready.
    `threads`: torch intra-op threads of the scoring thread (default: cores - 1, leaving one core to the
    event loop that parses requests: background + intra-op <= cores). `token`: required on /v1/predict."""
    from deeprec.security import is_loopback

    torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) - 1))
    if os.path.exists(os.path.join(path, MANIFEST)):
        folder, model = None, ServedModel(path)
    elif os.path.isdir(path):  # a training's export dir: bad exports and deltas refused, the last good one served
        folder = ExportFolder(path, lenient=True, check=lambda m: m.probe())
        model = folder.load()
    else:
        raise ServingError(f"{path}: no such export")
    app = make_app(model, max_batch, max_wait_ms, folder, watch_interval_s, max_rows=max_rows,
                   max_body_bytes=max_body_bytes, token=token)
    if token is None and not is_loopback(f"{host}:{port}"):
        log.warning("serving on %s without a token: anyone who reaches it may predict (--token-file)", host)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it: no Nagle delay
    try:
        sock.bind((host, port))
    except OSError as err:  # in use, or an address this host does not have
        sock.close()
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({err.strerror}); give another "
                          "--port (0: any free one)") from None
    sock.listen(1024)  # connections wait in the backlog until uvicorn accepts
    print(f"listening on http://{host}:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
