"""`deeprec serve PATH`: an HTTP inference server with dynamic batching, speaking three protocols.

    POST /v1/predict                    {"inputs": {"column": [value per row]}} -> {"scores": [...], "step": N}
                                        {"instances": [{"column": value}, ...]} -> {"predictions": [...], "step": N}
    POST /v1/models/{name}:predict      the same bodies, TF Serving's answers ({"outputs"} / {"predictions"})
    GET  /v1/models/{name}[/metadata]   TF Serving's model status and signature
    GET  /v2, /v2/health/{live,ready}   the Open Inference Protocol (KServe v2, Triton): server, health,
    GET  /v2/models/{name}[/ready]      model metadata and readiness,
    POST /v2/models/{name}/infer        inference, JSON or binary tensors (protocols.py)
    GET  /healthz, /metrics             {"status": "ok", "step": N, "model": the manifest's}; Prometheus text
    --grpc-port PORT                    also the Open Inference Protocol's gRPC service (KServe v2, Triton's
                                        inference.GRPCInferenceService) on this event loop, through the same
                                        batchers (grpc_service.py); prints `grpc listening on HOST:PORT`
                                        (with --workers N: every worker on that port, SO_REUSEPORT)

    request ──token? (401)──body <= max_body_bytes? (413)──decode, check the columns' shape (400)──>
        the model's queue ──batcher: what queued while the last batch scored, up to max_batch rows──>
        the scoring thread: the requests' columns merged, converted once (a bad value: each request
        alone, that one a 400 naming its JSON path), one model call ──> each request's rows (checked finite)

PATH is one export, a training's export dir, or a model repository (repository.py): each model gets its
own batcher, scoring thread and online-update watcher. A client's mistake is a 4xx naming it; a 5xx
is the server's own fault (logged with its traceback). Starlette + uvicorn (ASGI).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hmac
import logging
import os
import socket
import time
import zlib

import torch
import uvicorn
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from deeprec.errors import ConfigError
from deeprec.serving import RequestError
from deeprec.serving import protocols as p
from deeprec.serving.listen import bound
from deeprec.serving.batcher import Pending
from deeprec.serving.repository import Metrics, Missing, NonFinite, Served, find_served, model_name, open_repository

MAX_BODY_BYTES = 8 << 20  # --max-body-bytes: a larger body is a 413, its rest read and dropped (_drain)
# What a refusal (413, 401, 404) reads of the rest of the body before it answers, as nginx's lingering
# close does (see scoring). Beyond these, it closes anyway.
DRAIN_BYTES = 64 << 20
DRAIN_S = 5.0
MAX_ROWS = 8192  # --max-rows: rows of one request

log = logging.getLogger("deeprec.serve")


class _TooLarge(Exception):
    """A body over --max-body-bytes, of `size` bytes as far as read."""

    def __init__(self, size: int):
        super().__init__(size)
        self.size = size


def _declared_length(request: Request) -> int | None:
    declared = request.headers.get("content-length")
    return int(declared) if declared is not None and declared.isascii() and declared.isdigit() else None


async def _drain(request: Request) -> None:
    """Reads and drops what is left of the request's body, at most DRAIN_BYTES for DRAIN_S seconds,
    before a refusal is answered (the ASGI receive channel: the body may be half read). Nothing when
    the body was read to its end, or when the client waits for `100 Continue` before sending it (the
    refusal then spares it the upload)."""
    state = getattr(request.state, "body", "unread")
    if state == "read" or (state == "unread" and request.headers.get("expect", "").lower() == "100-continue"):
        return
    declared = _declared_length(request)
    if declared == 0 or (declared or 0) > DRAIN_BYTES:
        return
    read = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_S):
            while read <= DRAIN_BYTES:
                message = await request.receive()
                read += len(message.get("body", b""))
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return


def _json(value, status: int = 200, headers: dict | None = None) -> Response:
    return Response(p.dumps(value), status_code=status, media_type="application/json", headers=headers)


def make_app(models, max_batch: int = 256, max_wait_ms: float = 0.0, folder=None, watch_interval_s: float = 1.0,
             *, max_rows: int = MAX_ROWS, max_body_bytes: int = MAX_BODY_BYTES, token: str | None = None,
             grpc_address: tuple[str, int] | None = None, grpc_options: dict | None = None,
             name: str | None = None) -> Starlette:
    """`models`: a ServedModel, served as `name` (default: its export's folder name, or the followed
    export dir's: repository.model_name), or {name: ServedModel} (a repository: metrics labelled by
    model). `folder`: the ExportFolder a model follows ({name: folder} for several); new deltas and
    full exports in it are applied while serving. `token`: the scoring and model routes
    require `Authorization: Bearer <token>` (health, /v2 and /metrics stay open). `grpc_address`: (host,
    port) to serve gRPC on too (grpc_service.py), started and stopped with the app (its lifespan);
    `grpc_options`: more keywords of start_grpc (a worker's: reuse_port, metadata)."""
    labelled = isinstance(models, dict)
    if not labelled:
        name = model_name(folder.directory if folder is not None else models.path, name)
        models, folder = {name: models}, {name: folder}
    folders = folder if isinstance(folder, dict) else {}
    metrics = Metrics(labelled)
    served = {name: Served(name, model, folders.get(name), metrics, max_batch, max_wait_ms / 1000, watch_interval_s)
              for name, model in models.items()}
    expected = f"Bearer {token}".encode() if token else None

    def find(name: str | None, version: str | None = None) -> Served:
        if name is None:
            if len(served) == 1:
                return next(iter(served.values()))
            raise Missing(f"this server serves several models ({', '.join(served)}): name one, "
                          "POST /v1/models/NAME:predict or /v2/models/NAME/infer", 400)
        return find_served(served, name, version)

    async def read_body(request: Request) -> bytes:
        """The body (inflated), at most max_body_bytes (more: _TooLarge). request.state.body says how far
        it was read ("unread", "partial", "read"): a refusal drains the rest (_drain)."""
        declared = _declared_length(request)
        if declared is not None and declared > max_body_bytes:
            raise _TooLarge(declared)
        chunks, size, more = [], 0, True
        request.state.body = "partial"
        while more:  # ASGI's receive, not request.stream(): a refusal must know whether the client still sends
            message = await request.receive()
            if message["type"] == "http.disconnect":
                request.state.body = "read"  # nothing more will come
                raise ClientDisconnect()
            chunk, more = message.get("body", b""), message.get("more_body", False)
            size += len(chunk)
            if not more:
                request.state.body = "read"
            if size > max_body_bytes:
                raise _TooLarge(size)
            chunks.append(chunk)
        return _inflated(b"".join(chunks), request.headers.get("content-encoding"), max_body_bytes)

    def authorized(request: Request) -> bool:
        return expected is None or hmac.compare_digest(
            request.headers.get("authorization", "").encode("latin-1", "replace"), expected)

    def refused() -> Response:
        return _json({"error": "a bearer token is required: Authorization: Bearer <token>"}, 401,
                     {"WWW-Authenticate": "Bearer"})

    async def scoring(request: Request, answer) -> Response:
        """What every scoring route shares: the token, the body limit, a 500 for the server's own faults
        (logged), the metrics of the model that answered. `answer(request, holder)` names it in holder."""
        started, holder = time.perf_counter(), []
        try:
            response = refused() if not authorized(request) else await answer(request, holder)
        except _TooLarge as err:
            response = _json({"error": f"the body is over {max_body_bytes} bytes (--max-body-bytes): {err.size}"
                                       f"{'+' if request.headers.get('content-length') is None else ''} bytes; "
                                       "split the request"}, 413, {"Connection": "close"})
        except ClientDisconnect:  # gone before its body ended: nobody to answer, nothing to log
            response = Response(status_code=499)
        except NonFinite:
            response = _json({"error": "the model gave non-finite scores (logged by the server)"}, 500)
        except Exception:  # a bug of the server, never the client's: logged with its traceback
            log.exception("predict failed")
            response = _json({"error": "internal error (logged by the server)"}, 500)
        # a refusal sent before the body was read (401, 404, 413) waits for the rest of it: answering and
        # closing while the client still sends resets the connection, and a client that writes its whole
        # body before reading (urllib) sees the reset, never the answer
        await _drain(request)
        name = holder[0].name if holder else None
        metrics.count(name, response.status_code)  # as sent
        if holder:
            holder[0].latency.observe(time.perf_counter() - started)
        return response

    def v1_route(tf: bool):
        async def answer(request: Request, holder: list) -> Response:
            target, version = request.path_params.get("target"), request.path_params.get("version")
            name = request.path_params.get("name")
            if target is not None:
                name, _, verb = target.rpartition(":")
                if verb != "predict" or not name:
                    return _json({"error": f"{request.url.path}: POST /v1/models/NAME:predict (classify and "
                                           "regress are not served)"}, 404)
            try:
                model_served = find(name, version)
            except Missing as err:
                return _json({"error": str(err), "path": "$"}, err.status)
            holder.append(model_served)
            try:
                with model_served.batcher.arriving():  # the batch being formed waits for this request
                    model = model_served.model
                    columns, style = p.v1_columns(p.loads(await read_body(request)), model, max_rows)
                    located = p.at_rows if style == "instances" else (lambda err: err)
                    pending = Pending.checked(model.schema, columns, f"$.{style}", max_rows, located)
                if model_served.not_ready is not None:
                    return _json({"error": f"the model served cannot answer: {model_served.not_ready}"}, 503)
                scores, scored = await model_served.score(pending)  # its values are converted with the batch
            except RequestError as err:
                return _json({"error": str(err), "path": err.path}, 400)
            return _json(p.v1_answer(scores, scored, style, tf, scored.step))

        async def route(request: Request) -> Response:
            return await scoring(request, answer)

        return route

    async def v2_answer(request: Request, holder: list) -> Response:
        try:
            model_served = find(request.path_params["name"], request.path_params.get("version"))
        except Missing as err:
            return _json({"error": str(err)}, err.status)
        holder.append(model_served)
        model = model_served.model
        try:
            with model_served.batcher.arriving():  # the batch being formed waits for this request
                infer = p.v2_request(await read_body(request),
                                     request.headers.get("inference-header-content-length"), model, max_rows)
                pending = Pending.checked(model.schema, p.v2_columns(infer, model), "$.inputs", max_rows,
                                          functools.partial(p.at_inputs, request=infer))
            if model_served.not_ready is not None:
                return _json({"error": f"model {model_served.name!r} cannot answer: {model_served.not_ready}"}, 503)
            scores, scored = await model_served.score(pending)  # its values are converted with the batch
        except RequestError as err:
            return _json({"error": str(err)}, 400)
        body, headers = p.v2_answer(model_served.name, scored, infer, scores)
        return Response(body, headers=headers)

    def described(describe, guarded: bool = True):
        """A GET route about one model: describe(served) -> (body, status); 404 for no such model."""
        async def route(request: Request) -> Response:
            if guarded and not authorized(request):
                return refused()
            try:
                found = find(request.path_params["name"], request.path_params.get("version"))
            except Missing as err:
                return _json({"error": str(err)}, err.status)
            body, status = describe(found)
            return _json(body, status)

        return route

    async def healthz(request: Request) -> Response:
        ready = all(s.not_ready is None for s in served.values())
        if labelled:
            payload = {"status": "ok" if ready else "not ready", "models": {n: s.health() for n, s in served.items()}}
        else:
            payload = next(iter(served.values())).health()
        return _json(payload, 200 if ready else 503)

    async def live(request: Request) -> Response:
        return _json({"live": True})

    async def ready(request: Request) -> Response:
        ok = all(s.not_ready is None for s in served.values())
        return _json({"ready": ok}, 200 if ok else 503)

    async def server_metadata(request: Request) -> Response:
        return _json(p.server_metadata())

    async def repository_index(request: Request) -> Response:
        if not authorized(request):
            return refused()
        return _json([{"name": n, "version": str(s.model.step), "state": "READY" if s.not_ready is None else
                       "UNAVAILABLE", "reason": s.not_ready or ""} for n, s in served.items()])

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics.exposed), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()
        watchers = []
        for s in served.values():
            s.batcher.start()
            if s.folder is not None:
                watchers.append(loop.create_task(s.watch()))
        grpc_server = None
        if grpc_address is not None:  # on this loop, uvicorn's (uvloop): grpc.aio runs on it
            from deeprec.serving.grpc_service import start_grpc

            grpc_server, address = await start_grpc(served, *grpc_address, token=token, max_rows=max_rows,
                                                    max_body_bytes=max_body_bytes, **(grpc_options or {}))
            print(f"grpc listening on {address}", flush=True)  # a worker's: to the supervisor, which prints it once
        yield
        if grpc_server is not None:  # before the batchers stop: the calls in flight are answered
            from deeprec.serving.grpc_service import GRACE_S

            await grpc_server.stop(GRACE_S)
        for task in [*watchers, *(s.batcher.task for s in served.values())]:
            task.cancel()
        for s in served.values():
            s.batcher.scorer.shutdown(wait=True)

    def model_ready(s: Served):
        return {"name": s.name, "ready": s.not_ready is None}, 200 if s.not_ready is None else 503

    metadata = described(lambda s: (p.v2_metadata(s.name, s.model), 200))
    status = described(lambda s: (p.tf_status(s.model, s.not_ready), 200))
    v1, tf = v1_route(False), v1_route(True)

    async def v2(request: Request) -> Response:
        return await scoring(request, v2_answer)

    routes = [Route("/v1/predict", v1, methods=["POST"]), Route("/healthz", healthz), Route("/metrics", prometheus),
              Route("/v1/models/{target}", tf, methods=["POST"]),
              Route("/v1/models/{name}/versions/{version}:predict", tf, methods=["POST"]),
              Route("/v1/models/{name}", status), Route("/v1/models/{name}/versions/{version}", status),
              Route("/v1/models/{name}/metadata", described(lambda s: (p.tf_metadata(s.name, s.model), 200))),
              Route("/v2", server_metadata), Route("/v2/health/live", live), Route("/v2/health/ready", ready),
              Route("/v2/repository/index", repository_index, methods=["POST"]),
              Route("/v2/models/{name}", metadata), Route("/v2/models/{name}/versions/{version}", metadata),
              Route("/v2/models/{name}/ready", described(model_ready, guarded=False)),
              Route("/v2/models/{name}/versions/{version}/ready", described(model_ready, guarded=False)),
              Route("/v2/models/{name}/config", described(lambda s: (p.triton_config(s.name, s.model), 200))),
              Route("/v2/models/{name}/infer", v2, methods=["POST"]),
              Route("/v2/models/{name}/versions/{version}/infer", v2, methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.metrics = metrics
    return app


def _inflated(body: bytes, encoding: str | None, limit: int) -> bytes:
    """A body sent with Content-Encoding gzip or deflate (tritonclient's request compression), inflated
    up to `limit` bytes (more: 413)."""
    if encoding is None or encoding.strip().lower() in ("", "identity"):
        return body
    wbits = {"gzip": 31, "deflate": 15}.get(encoding.strip().lower())
    if wbits is None:
        raise RequestError(f"Content-Encoding {encoding!r} is not served (gzip, deflate or none)")
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as err:
        raise RequestError(f"the body is not {encoding.strip().lower()} ({err})") from None
    if len(out) > limit:
        raise _TooLarge(len(out))
    if not inflater.eof:
        raise RequestError(f"the {encoding.strip().lower()} body ends before its end")
    return out


def serve(path: str, host: str = "127.0.0.1", port: int = 8080, max_batch: int = 256,
          max_wait_ms: float = 0.0, threads: int | None = None, watch_interval_s: float = 1.0, *,
          max_rows: int = MAX_ROWS, max_body_bytes: int = MAX_BODY_BYTES, token: str | None = None,
          grpc_port: int | None = None,
          name: str | None = None, workers: int = 1) -> None:
    """Serve the export, export dir or model repository at `path` until interrupted; prints
    `listening on http://host:port` when ready. `name`: a single export's name (default: its
    folder's). `threads`: torch intra-op threads of the scoring threads (default: cores - 1, leaving
    one core to the event loop that parses requests). `workers` > 1: that many processes on the one
    port, each running this function, under a supervisor (serving.workers; threads: per worker)."""
    arguments = dict(locals())  # serve's own, by name: each worker gets them all
    from deeprec.security import is_loopback
    from deeprec.serving.workers import current, supervise

    if grpc_port is not None and grpc_port == port != 0:
        raise ConfigError(f"--grpc-port {grpc_port} is --port's: give gRPC a port of its own (0: any free one)")
    if workers > 1:
        return supervise(serve, arguments, workers)
    worker = current()  # a worker of `--workers N`: its sockets share the supervisor's ports
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) - 1))
    grpc = None if grpc_port is None else (host, grpc_port)  # the gRPC service too (grpc_service.py)
    if grpc is not None and worker is None:  # a port in use stops the start now, before the models load (a
        # worker's is held by the supervisor, which checked it: this bind, without SO_REUSEPORT, would clash
        # with the other workers' listeners)
        from deeprec.serving.grpc_service import check_address

        check_address(*grpc)
    grpc_options = worker.grpc_options() if worker is not None and grpc is not None else None
    opened, repository = open_repository(path, name)
    models = {name: model for name, (model, _) in opened.items()}
    folders = {name: folder for name, (_, folder) in opened.items()}
    if repository:
        app = make_app(models, max_batch, max_wait_ms, folders, watch_interval_s, max_rows=max_rows,
                       max_body_bytes=max_body_bytes, token=token, grpc_address=grpc, grpc_options=grpc_options)
    else:
        (name, model), = models.items()
        app = make_app(model, max_batch, max_wait_ms, folders[name], watch_interval_s, max_rows=max_rows,
                       max_body_bytes=max_body_bytes, token=token, name=name, grpc_address=grpc,
                       grpc_options=grpc_options)
    if token is None and not is_loopback(f"{host}:{port}"):
        log.warning("serving on %s without a token: anyone who reaches it may predict (--token-file)", host)
    # a worker's shares the port with the other workers': the kernel spreads the connections over them
    sock = bound(host, port, "--port", reuse_port=worker is not None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it: no Nagle delay
    sock.listen(1024)  # connections wait in the backlog until uvicorn accepts
    print(f"listening on http://{host}:{sock.getsockname()[1]}", flush=True)
    print(f"{'models' if repository else 'model'}: {', '.join(models)}", flush=True)
    if worker is not None:  # ready once the app's startup ran: the lines printed go to the supervisor, which
        worker.serving(app)  # prints them once every worker is
    # the models, torch and the libraries loaded: out of the collector's sight. A full collection
    # would otherwise walk them all, stalling every request for 150-200 ms (seen once a second at 8 clients)
    gc.freeze()
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
