"""deeprec serve, side by side: the ExportedProgram (traced) and the AOTInductor package (compiled),
in process and over HTTP (v1 columns, v2 JSON, v2 binary tensors), at 1 and 64 rows, with 1 and 8
clients; where the time goes (the handler's stages in process, the server's event loop profiled);
the time to apply an online delta.

    python bench/serving.py                 # the one command (about 3-4 minutes on 2 cores)
    python bench/serving.py --requests 200  # fewer requests per measurement
    python bench/serving.py --peer-only     # in process and the ONNX Runtime peer only (no HTTP; about a minute)
    python bench/serving.py --grpc-only     # gRPC and HTTP v2 beside it, compiled only (serving_grpc.json)
    python bench/serving.py --grpc-only --before DIR  # and gRPC served by DIR's deeprec, rounds alternating

A DLRM with EmbeddingVariables, trained briefly on the bundled Criteo sample, is exported with its
compiled package, and a copy without it is made (the loader then scores with the traced program).
Each variant is served by `deeprec serve --threads 1` (the default on 2 cores: cores - 1) in its own
process; this process is the client, on loopback. The client is lean, since it shares the 2 cores
with the server: bodies pre-encoded with orjson, a minimal HTTP/1.1 keep-alive client on a blocking
socket (1 client) or on asyncio streams (8 clients), no HTTP library on the request path (http.client
is measured once beside it, for its own overhead). Requests carry real rows of the sample.
ONNX Runtime on the same model is the peer row, in process (bench/serving_peer.py).
The compiled variant's server also serves gRPC (`--grpc-port 0`: KServe v2 / Triton ModelInfer), measured
beside HTTP with a client as lean (pre-serialized requests on grpc's raw-bytes API: bench/serving_grpc.py),
its scores checked to equal HTTP v2's first.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import orjson

import serving_grpc
import serving_peer
from _common import cpu_line, print_table, save_figure, save_json

HOST = "127.0.0.1"
VARIANTS = ("traced", "compiled")
PROTOCOLS = ("v1", "v2-json", "v2-binary")
HTTP_ROWS = (1, 64)
IN_PROCESS_ROWS = (1, 64, 256)
SERVER_THREADS = 1  # deeprec serve's default on 2 cores (cores - 1): one core left to the event loop
TARGETS = {"in_process_1_row_ms": 0.5, "http_1_row_p50_ms": 2.0, "http_1_row_p99_ms": 4.0,
           "clients_8_1_row_rows_per_s": 3000.0, "clients_8_64_rows_rows_per_s": 40000.0,
           "grpc_1_row_p50_ms": 1.0, "grpc_1_row_p99_ms": 3.0, "grpc_clients_8_1_row_rows_per_s": 5000.0,
           "grpc_clients_8_64_rows_rows_per_s": 40000.0}
V2 = ("v2-json", "v2-binary")  # --grpc-only's HTTP protocols, beside gRPC


# -- the model ------------------------------------------------------------------------------------

def sample_rows(path: str, schema, n: int = 200) -> dict:
    """The first n rows of the sample as JSON-like columns (a client's view: strings, floats, None)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from test_serving import _json_rows  # the tests' client view of the sample, one definition

    return _json_rows(path, schema, n)


def exported_model(folder: str) -> str:
    """A DLRM with EmbeddingVariables trained 5 steps on the Criteo sample, exported with its package."""
    import deeprec as dr
    from deeprec.cli import sample_path
    from deeprec.trainer import TrainConfig, Trainer

    trainer = Trainer(TrainConfig.create(model="dlrm", data=[sample_path("criteo_sample.txt")], steps=5,
                                         batch_size=64, embedding="variable", progress=False))
    trainer.train()
    path = dr.export(trainer.model, os.path.join(folder, "export"), schema=trainer.schema, model_name="dlrm",
                     step=5, compile=True, progress=False)
    with open(os.path.join(path, "manifest.json")) as f:
        if "cpu" not in json.load(f).get("compiled", []):
            raise SystemExit(f"{path}: the export has no compiled CPU package (its compile or test load failed)")
    return path


def traced_copy(path: str, folder: str) -> str:
    """A copy of the export without its compiled package: served by the ExportedProgram."""
    from deeprec.serving.compiled import package_name

    copy = os.path.join(folder, "traced")
    shutil.copytree(path, copy)
    os.remove(os.path.join(copy, package_name("cpu")))
    with open(os.path.join(copy, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["compiled"] = []
    manifest["sha256"].pop(package_name("cpu"), None)
    with open(os.path.join(copy, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    return copy


def rows_of(rows: dict, n: int, start: int = 0) -> dict:
    """n rows (cycling over the sample's)."""
    size = len(next(iter(rows.values())))
    picks = [(start + i) % size for i in range(n)]
    return {k: [v[i] for i in picks] for k, v in rows.items()}


# -- statistics -----------------------------------------------------------------------------------

def pct(samples: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(samples)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


def latency_stats(seconds: list[float]) -> dict:
    ms = [s * 1e3 for s in seconds]
    return {"p50_ms": statistics.median(ms), "p99_ms": pct(ms, 0.99), "mean_ms": statistics.fmean(ms),
            "requests": len(ms)}


def timed(fn, n: int, warmup: int = 10, budget_s: float = math.inf) -> list[float]:
    """n timings of fn() (after warmup calls), fewer (at least 20) if they take more than budget_s."""
    for _ in range(warmup):
        fn()
    out, began = [], time.perf_counter()
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
        if len(out) >= 20 and start - began > budget_s:
            break
    return out


# -- request bodies -------------------------------------------------------------------------------

def raw_tensors(served, columns: dict) -> list[tuple[str, str, int, bytes]]:
    """(name, datatype, rows, raw little-endian values) per column: the v2 binary body's tensors, and
    gRPC's raw_input_contents."""
    from deeprec.serving import protocols as p

    types, out = {c.name: p.datatype(c) for c in p.model_inputs(served)}, []
    for k, v in columns.items():
        if types[k] == "FP32":
            blob = np.array([math.nan if x is None else x for x in v], "<f4").tobytes()
        elif types[k] == "INT64":
            blob = np.array([-1 if x in (None, "") else int(x) for x in v], "<i8").tobytes()
        else:
            blob = b"".join(len(b).to_bytes(4, "little") + b for b in (("" if x is None else str(x)).encode()
                                                                         for x in v))
        out.append((k, types[k], len(v), blob))
    return out


def bodies(served, rows: dict, n: int, start: int = 0) -> dict:
    """{protocol: (path, body, extra headers)} for n rows, encoded once."""
    from deeprec.serving.repository import model_name

    name = model_name(served.path)  # what deeprec serve names it: the export's folder
    columns = rows_of(rows, n, start)
    tensors = raw_tensors(served, columns)
    infer = f"/v2/models/{name}/infer"
    v2_json = {"inputs": [{"name": k, "datatype": kind, "shape": [n], "data": columns[k]}
                          for k, kind, _, _ in tensors]}
    header = [{"name": k, "datatype": kind, "shape": [n], "parameters": {"binary_data_size": len(blob)}}
              for k, kind, _, blob in tensors]
    blobs = [blob for *_, blob in tensors]
    head = orjson.dumps({"inputs": header, "parameters": {"binary_data_output": True}})
    return {"v1": ("/v1/predict", orjson.dumps({"inputs": columns}), {}),
            "v2-json": (infer, orjson.dumps(v2_json), {}),
            "v2-binary": (infer, head + b"".join(blobs), {"Inference-Header-Content-Length": str(len(head))})}


def http_request(path: str, body: bytes | None, headers: dict) -> bytes:
    lines = [f"{'POST' if body is not None else 'GET'} {path} HTTP/1.1", f"Host: {HOST}"]
    if body is not None:
        kind = "application/octet-stream" if headers else "application/json"
        lines += [f"Content-Type: {kind}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def _content_length(head: bytes) -> int:
    at = head.lower().find(b"\r\ncontent-length:")
    if at < 0:
        raise RuntimeError(f"an answer without Content-Length: {head[:200]!r}")
    end = head.find(b"\r\n", at + 2)
    return int(head[at + 17:end if end >= 0 else len(head)])


# -- the clients ----------------------------------------------------------------------------------

class Connection:
    """A minimal HTTP/1.1 keep-alive client on a blocking socket: write the request, read the head up
    to the blank line, then Content-Length bytes."""

    def __init__(self, port: int):
        self.sock = socket.create_connection((HOST, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""

    def call(self, request: bytes) -> tuple[int, bytes]:
        self.sock.sendall(request)
        buffer = self.buffer
        while (end := buffer.find(b"\r\n\r\n")) < 0:
            buffer += self._recv()
        head, start = buffer[:end + 2], end + 4
        stop = start + _content_length(head)
        while len(buffer) < stop:
            buffer += self._recv()
        self.buffer = buffer[stop:]
        return int(head[9:12]), buffer[start:stop]

    def _recv(self) -> bytes:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise RuntimeError("the server closed the connection")
        return chunk

    def close(self) -> None:
        self.sock.close()


def checked(status: int, body: bytes, what: str) -> bytes:
    if status != 200:
        raise RuntimeError(f"{what}: HTTP {status}: {body[:300]!r}")
    return body


def one_client(port: int, request: bytes, n: int, what: str) -> dict:
    conn = Connection(port)
    try:
        for _ in range(10):
            checked(*conn.call(request), what)
        times = []
        for _ in range(n):
            start = time.perf_counter()
            status, body = conn.call(request)
            times.append(time.perf_counter() - start)
            if status != 200:
                checked(status, body, what)
    finally:
        conn.close()
    return latency_stats(times)


def stdlib_client_overhead(port: int, path: str, body: bytes | None, headers: dict, n: int) -> dict:
    """The same request through http.client (the standard library) and through the lean client,
    alternately (so both see the same load): http.client's own cost per request."""
    import http.client

    conn, lean = http.client.HTTPConnection(HOST, port), Connection(port)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    headers = {"Content-Type": "application/json", **headers}
    request = http_request(path, body, {} if body is None else headers)
    times = {"http.client": [], "lean": []}
    try:
        for i in range(n + 10):
            start = time.perf_counter()
            conn.request("POST" if body is not None else "GET", path, body, headers)
            response = conn.getresponse()
            checked(response.status, response.read(), path)
            middle = time.perf_counter()
            checked(*lean.call(request), path)
            if i >= 10:
                times["http.client"].append(middle - start)
                times["lean"].append(time.perf_counter() - middle)
    finally:
        conn.close()
        lean.close()
    return {k: latency_stats(v) for k, v in times.items()}


async def _open(port: int, clients: int) -> list:
    out = []
    for _ in range(clients):
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out.append((reader, writer))
    return out


async def _client_loop(reader, writer, request: bytes, count: int, times: list | None, what: str) -> None:
    for _ in range(count):
        start = time.perf_counter()
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        body = await reader.readexactly(_content_length(head))
        if times is not None:
            times.append(time.perf_counter() - start)
        if head[9:12] != b"200":
            checked(int(head[9:12]), body, what)


async def _many_clients(port: int, requests: list[bytes], total: int, what: str) -> tuple[float, list, int]:
    conns = await _open(port, len(requests))
    try:
        await asyncio.gather(*(_client_loop(r, w, req, 10, None, what) for (r, w), req in zip(conns, requests)))
        per, times = max(1, total // len(requests)), []
        start = time.perf_counter()
        await asyncio.gather(*(_client_loop(r, w, req, per, times, what) for (r, w), req in zip(conns, requests)))
        return time.perf_counter() - start, times, per * len(requests)
    finally:
        for _, w in conns:
            w.close()


# -- the server -----------------------------------------------------------------------------------

class Server:
    """`deeprec serve PATH --port 0 --threads 1` in a subprocess (or under cProfile, `profile` the
    file prefix its event-loop thread's profiles are written to, one per SIGUSR1); `grpc`: with
    `--grpc-port 0` too (its address, HOST:PORT, in .grpc)."""

    def __init__(self, path: str, log: str, profile: str | None = None, source: str | None = None,
                 name: str | None = None, grpc: bool = False):
        # every variant under one name (`bodies`' URLs): the traced copy's folder would name it otherwise
        args = ["serve", path, "--port", "0", "--threads", str(SERVER_THREADS)] + (["--model-name", name] if name else [])
        args += ["--grpc-port", "0"] if grpc else []
        # another checkout's deeprec: `python -m` puts the working directory first on sys.path
        env = None if source is None else {**os.environ, "PYTHONPATH": source}
        if profile is None:
            command = [sys.executable, "-m", "deeprec", *args]
        else:  # the harness keeps its process: it preloads what `deeprec serve` would re-execute with
            command = [sys.executable, "-c", _PROFILED, profile, *args]
            from deeprec.serving.allocator import mimalloc_library

            if mimalloc_library():
                env = {**(env or os.environ), "LD_PRELOAD": mimalloc_library(), "DEEPREC_ALLOCATOR_SET": "1"}
        self.log = open(log, "w")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                        cwd=source)
        deadline, self.port, self.grpc = time.monotonic() + 300, None, None
        while True:  # `listening on http://HOST:PORT`, then (the app started) `grpc listening on HOST:PORT`
            line = self.process.stdout.readline()
            if line.startswith("listening on http://"):
                self.port = int(line.strip().rsplit(":", 1)[1])
            elif line.startswith("grpc listening on "):
                self.grpc = line.split()[-1]
            if self.port is not None and (self.grpc is not None or not grpc):
                break
            if not line or time.monotonic() > deadline:
                self.stop()
                with open(log) as f:
                    raise RuntimeError(f"deeprec serve did not start:\n{f.read()[-3000:]}")
        self.conn = Connection(self.port)

    def get(self, path: str) -> bytes:
        return checked(*self.conn.call(http_request(path, None, {})), path)

    def metrics(self) -> dict:
        """The counters of the latency and batch-size histograms."""
        out = {}
        for line in self.get("/metrics").decode().splitlines():
            name, _, value = line.partition(" ")
            if name in ("deeprec_request_latency_seconds_sum", "deeprec_request_latency_seconds_count",
                        "deeprec_batch_rows_sum", "deeprec_batch_rows_count"):
                out[name] = float(value)
        return out

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


# the server under cProfile, its event-loop (main) thread, timed by that thread's CPU clock (idle time in
# epoll and waits for the GIL left out); SIGUSR1 writes the profile so far to PREFIX.<n> and starts anew
_PROFILED = """
import cProfile, signal, sys, time
prefix, argv = sys.argv[1], sys.argv[2:]
state = {"profile": cProfile.Profile(time.thread_time), "n": 0}
def dump(*_):
    state["profile"].disable()
    state["profile"].dump_stats(f"{prefix}.{state['n']}.tmp")
    import os
    os.replace(f"{prefix}.{state['n']}.tmp", f"{prefix}.{state['n']}")
    state["n"] += 1
    state["profile"] = cProfile.Profile(time.thread_time)
    state["profile"].enable()
signal.signal(signal.SIGUSR1, dump)
from deeprec.cli import main
state["profile"].enable()
try:
    main(argv)
finally:
    state["profile"].disable()
"""


def measure_http(server: Server, served, rows: dict, requests: int, clients: int,
                 protocols: tuple = PROTOCOLS) -> dict:
    out = {"floor_get_live": one_client(server.port, http_request("/v2/health/live", None, {}), requests,
                                        "/v2/health/live")}
    for n in HTTP_ROWS:
        single = bodies(served, rows, n)
        several = [bodies(served, rows, n, start=17 * i) for i in range(clients)]
        for protocol in protocols:
            what = f"{protocol}, {n} rows"
            request, reqs = http_request(*single[protocol]), [http_request(*b[protocol]) for b in several]
            out.setdefault(protocol, {})[str(n)] = measure_load(
                server, protocol, n, clients, requests, lambda: one_client(server.port, request, requests, what),
                lambda total: asyncio.run(_many_clients(server.port, reqs, total, what)))
    return out


def measure_load(server: Server, label: str, n: int, clients: int, requests: int, one, many) -> dict:
    """{"1_client": latency (`one()`: its stats), "N_clients": rows/s, latency, rows per model call and
    CPU per request of `many(total)` -> (seconds, latencies, requests done)}, from the server's metrics.
    The clients make as many requests as the latency loop, at least 50 each (25 at more than 1 row)."""
    before = server.metrics()
    lat = one()
    lat["server_handler_mean_ms"] = _mean_delta(before, server.metrics(), "deeprec_request_latency_seconds") * 1e3
    total = max(requests, 50 * clients) if n == 1 else max(requests // 2, 25 * clients)
    before, cpu_server, cpu_client = server.metrics(), server.cpu_seconds(), time.process_time()
    elapsed, times, done = many(total)
    cpu_server, cpu_client = server.cpu_seconds() - cpu_server, time.process_time() - cpu_client
    after = server.metrics()
    loaded = {"rows_per_s": done * n / elapsed, "requests_per_s": done / elapsed, "requests": done,
              **{k: v for k, v in latency_stats(times).items() if k != "requests"},
              "rows_per_model_call": _mean_delta(before, after, "deeprec_batch_rows") or None,
              "server_cpu_ms_per_request": cpu_server / done * 1e3,
              "client_cpu_ms_per_request": cpu_client / done * 1e3,
              "cores_busy_with_server_and_client": (cpu_server + cpu_client) / elapsed}
    print(f"  {label:9} {n:3} rows: 1 client p50 {lat['p50_ms']:.2f} ms p99 {lat['p99_ms']:.2f} ms; "
          f"{clients} clients {loaded['rows_per_s']:,.0f} rows/s ({loaded['rows_per_model_call'] or 0:.1f} rows "
          f"per model call)", flush=True)
    return {"1_client": lat, f"{clients}_clients": loaded}


def _mean_delta(before: dict, after: dict, name: str) -> float:
    count = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
    return (after.get(f"{name}_sum", 0) - before.get(f"{name}_sum", 0)) / count if count else 0.0


def measure_grpc(server: Server, served, rows: dict, requests: int, clients: int) -> dict:
    """gRPC ModelInfer on `server` (started with gRPC), as measure_http per protocol, the same rows (the
    v2 binary body's tensors as raw_input_contents); first, its scores checked to equal HTTP v2's (JSON and
    binary) for the same rows, exactly, at each row count (bench/serving_grpc.py)."""
    from deeprec.serving.repository import model_name

    name = model_name(served.path)
    reqs = {n: [serving_grpc.request_bytes(name, raw_tensors(served, rows_of(rows, n, 17 * i)))
                for i in range(clients)] for n in HTTP_ROWS}
    checks = []
    for n in HTTP_ROWS:
        http = {p: checked(*server.conn.call(http_request(*b)), p) for p, b in bodies(served, rows, n).items()
                if p in V2}
        checks.append(serving_grpc.check_equal(server.grpc, reqs[n][0], http, n))
    print(f"  gRPC scores equal HTTP v2's (JSON and binary answers), bit for bit, at {', '.join(map(str, HTTP_ROWS))} "
          "rows", flush=True)
    echo = serving_grpc.floor(server.grpc, reqs[1][:clients], 1, max(requests, 50 * clients))
    print(f"  gRPC floor (an echo server, same client): {clients} clients x 1 row {echo['requests_per_s']:,.0f} "
          f"requests/s, {echo['server_cpu_ms_per_request']:.2f} ms server CPU a request, "
          f"{echo['client_cpu_ms_per_request']:.2f} ms the clients'", flush=True)
    return {"address": server.grpc, "client": serving_grpc.CLIENT, "scores_equal_http_v2": checks, "floor": echo,
            **{str(n): measure_load(server, "gRPC", n, clients, requests,
                                    lambda: latency_stats(serving_grpc.one_client(server.grpc, r[0], n, requests,
                                                                                  f"gRPC, {n} rows")),
                                    lambda total: asyncio.run(serving_grpc.many_clients(
                                        server.grpc, r[:clients], n, total, f"gRPC, {n} rows")))
               for n, r in reqs.items()}}


# -- in process -----------------------------------------------------------------------------------

def in_process(served, rows: dict, requests: int, threads: list[int]) -> dict:
    """served(columns) (a client's JSON-like columns: conversion + model) and served(raw batch) (the
    model call alone), traced and compiled, per torch thread count and rows."""
    import torch

    compiled, out = served.compiled, {}
    try:
        for variant in VARIANTS:
            served.compiled = compiled if variant == "compiled" else None
            for t in threads:
                torch.set_num_threads(t)
                for n in IN_PROCESS_ROWS:
                    columns = rows_of(rows, n)
                    raw = served.batch(columns)
                    count = requests if n < 256 else max(30, requests // 4)
                    budget = 5.0 if t == SERVER_THREADS else 2.0  # 2 threads on 2 shared cores can crawl
                    entry = {"columns": latency_stats(timed(lambda: served(columns), count, budget_s=budget)),
                             "raw_batch": latency_stats(timed(lambda: served(raw), count, budget_s=budget))}
                    out.setdefault(variant, {}).setdefault(f"threads_{t}", {})[str(n)] = entry
                    print(f"  {variant:8} {t} thread(s) {n:3} rows: columns p50 {entry['columns']['p50_ms']:.3f} ms, "
                          f"raw batch p50 {entry['raw_batch']['p50_ms']:.3f} ms", flush=True)
    finally:
        served.compiled = compiled
    return out


class _TimedProgram:
    def __init__(self, program):
        self.program, self.seconds = program, 0.0

    def __call__(self, batch):
        start = time.perf_counter()
        out = self.program(batch)
        self.seconds += time.perf_counter() - start
        return out


def handler_stages(served, rows: dict, requests: int) -> dict:
    """What the server does for one request, stage by stage, in process (the server's code, without
    HTTP and the batcher's hop to its scoring thread): mean ms of decode (JSON, or the v2 header and
    binary tensors), convert (columns -> the model's raw batch), score (ServedModel: the program plus
    its wrapping), of which the program alone, and encode (the answer's JSON)."""
    import torch

    from deeprec.serving import protocols as p
    from deeprec.serving.server import MAX_ROWS

    torch.set_num_threads(SERVER_THREADS)
    compiled, module, out = served.compiled, served.module, {}
    try:
        for variant in VARIANTS:
            for n in HTTP_ROWS:
                encoded = bodies(served, rows, n)
                for protocol in PROTOCOLS:
                    _, body, headers = encoded[protocol]
                    program = _TimedProgram(compiled if variant == "compiled" else module)
                    served.compiled = program if variant == "compiled" else None
                    if variant == "traced":
                        served.module = program
                    stages = {"decode": [], "convert": [], "score": [], "program": [], "encode": []}
                    for i in range(requests + 10):
                        program.seconds = 0.0
                        t0 = time.perf_counter()
                        if protocol == "v1":
                            columns, style = p.v1_columns(p.loads(body), served)
                        else:
                            infer = p.v2_request(body, headers.get("Inference-Header-Content-Length"), served)
                            columns = p.v2_columns(infer, served)
                        t1 = time.perf_counter()
                        batch = served.batch(columns, "$.inputs", MAX_ROWS)
                        t2 = time.perf_counter()
                        scores = served(batch).numpy()
                        t3 = time.perf_counter()
                        if protocol == "v1":
                            p.dumps(p.v1_answer(scores, served, style, False, served.step))
                        else:
                            p.v2_answer(served.manifest["model"], served, infer, scores)
                        t4 = time.perf_counter()
                        if i >= 10:
                            for key, seconds in zip(stages, (t1 - t0, t2 - t1, t3 - t2, program.seconds, t4 - t3)):
                                stages[key].append(seconds * 1e3)
                    entry = {k: statistics.fmean(v) for k, v in stages.items()}  # means: they add up
                    entry["total"] = entry["decode"] + entry["convert"] + entry["score"] + entry["encode"]
                    out.setdefault(variant, {}).setdefault(protocol, {})[str(n)] = entry
                    served.compiled, served.module = compiled, module
    finally:
        served.compiled, served.module = compiled, module
    return out


# -- the server profiled ----------------------------------------------------------------------------

_HTTP, _APP, _LOOP = "HTTP/1.1 parse and write (h11)", "Starlette (routing, request, response)", "asyncio event loop"
_CONVERT, _BATCHER = "convert: columns -> raw batch (request.py, pyarrow, schema)", "batcher (repository.py, executor)"
_CATEGORIES = [("/h11/", _HTTP), ("/uvicorn/", "uvicorn (ASGI server)"), ("/starlette/", _APP), ("/anyio/", _APP),
               ("/asyncio/", _LOOP), ("selectors.py", _LOOP),
               ("deeprec/serving/protocols", "decode and encode (protocols.py, orjson)"),
               ("deeprec/serving/request", _CONVERT), ("/pyarrow/", _CONVERT), ("deeprec/data/", _CONVERT),
               ("deeprec/ragged", _CONVERT), ("deeprec/serving/__init__", _CONVERT),
               ("deeprec/serving/server", "handler (server.py)"), ("deeprec/serving/repository", _BATCHER),
               ("concurrent/futures", _BATCHER), ("prometheus_client", "metrics (prometheus_client)"),
               ("/torch/", "torch"), ("deeprec/", "deeprec, other")]


def _category(key) -> str | None:
    """The stage a function's file belongs to; None for a C function or a stdlib helper (typing, re,
    os, ...): their time is counted with their callers'."""
    file = key[0].replace("\\", "/")
    for pattern, name in _CATEGORIES:
        if pattern in file:
            return name
    return None


def summarize_profile(path: str, requests: int, top: int = 12) -> dict:
    """The event-loop thread's CPU time per request by stage: each function's own time counted in its
    file's stage, that of a C function or a stdlib helper in its callers' (as they called it). Shares
    are the useful part: cProfile's own cost (a clock read per call) inflates the milliseconds, more
    where calls are many and short."""
    import pstats

    stats = pstats.Stats(path).stats
    memo: dict = {}

    def stages_of(key, seen: frozenset) -> dict:
        """{stage: fraction} of the time spent in `key`."""
        if key in memo:
            return memo[key]
        category = _category(key)
        if category is not None:
            return {category: 1.0}
        callers = stats[key][4] if key in stats else {}
        weights = {c: v[3] for c, v in callers.items() if isinstance(v, tuple) and c not in seen}
        total = sum(weights.values())
        if total <= 0:
            return {"other (no Python caller)": 1.0}
        out: dict = {}
        for caller, weight in weights.items():
            for name, share in stages_of(caller, seen | {key}).items():
                out[name] = out.get(name, 0.0) + share * weight / total
        memo[key] = out
        return out

    by, total = {}, 0.0
    for key, (_, _, own, _, callers) in stats.items():
        total += own
        if _category(key) is not None:
            by[_category(key)] = by.get(_category(key), 0.0) + own
            continue
        edges = {c: v[2] for c, v in callers.items() if isinstance(v, tuple)}
        rest = own - sum(edges.values())
        for caller, seconds in [*edges.items(), *([(None, rest)] if rest > 1e-9 else [])]:
            for name, share in (stages_of(caller, frozenset({key})) if caller is not None else
                                {"other (no Python caller)": 1.0}).items():
                by[name] = by.get(name, 0.0) + seconds * share
    ranked = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return {"requests": requests, "event_loop_cpu_ms_per_request_profiled": total / requests * 1e3,
            "share_by_stage": {k: v / total for k, v in sorted(by.items(), key=lambda kv: -kv[1])},
            "ms_per_request_by_stage_profiled": {k: v / requests * 1e3 for k, v in sorted(by.items(),
                                                                                          key=lambda kv: -kv[1])},
            "top_functions_own_ms_per_request_profiled": [
                {"function": f"{os.path.basename(k[0])}:{k[1]}({k[2]})" if k[0] != "~" else k[2],
                 "calls_per_request": v[1] / requests, "own_ms": v[2] / requests * 1e3} for k, v in ranked]}


def profile_server(path: str, served, rows: dict, requests: int, clients: int, folder: str) -> dict:
    """The compiled variant's server under cProfile (its event-loop thread, by CPU time: the scoring
    thread runs the model, measured in process), one profile per load, v1 columns."""
    prefix = os.path.join(folder, "profile")
    server = Server(path, os.path.join(folder, "profiled.log"), profile=prefix)
    loads = [("1 client, 1 row", 1, 1), (f"{clients} clients, 1 row", 1, clients),
             (f"{clients} clients, 64 rows", 64, clients)]
    out = {}

    def dump(k: int) -> str:
        server.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{prefix}.{k}") and time.monotonic() < deadline:
            time.sleep(0.05)
        return f"{prefix}.{k}"

    try:
        server.get("/v2/health/live")
        dump(0)  # the start (imports, loading the model): left out
        for k, (name, n, count) in enumerate(loads, 1):
            reqs = [http_request(*bodies(served, rows, n, start=17 * i)["v1"]) for i in range(count)]
            if count == 1:
                one_client(server.port, reqs[0], requests, name)
                done = requests + 10
            else:
                _, _, done = asyncio.run(_many_clients(server.port, reqs, max(requests, 25 * count), name))
                done += 10 * count
            out[name] = summarize_profile(dump(k), done)
    finally:
        server.stop()
    return out


# -- online deltas ----------------------------------------------------------------------------------

def delta_apply(path: str, repeats: int = 3) -> dict:
    """Time to apply a delta (in process, compiled export): 100k new EmbeddingVariable rows (more than the
    headroom: scoring falls back to the ExportedProgram, warned), and an update of every known key's
    row (fits: the compiled program is re-bound to the new tensors). Both with all dense weights."""
    import torch
    from safetensors.torch import save_file

    import deeprec as dr
    from deeprec.atomic import write_with_manifest
    from deeprec.serving import CompiledFallbackWarning
    from deeprec.serving.export import FORMAT
    from deeprec.serving.frozen import _SENTINEL
    from deeprec.serving.online import apply_delta

    served = dr.serving.load(path)
    variables = sorted({k.rsplit(".", 1)[0] for k in served.module.state_dict() if k.endswith(".sorted_keys")})
    dense = {k: v.clone() for k, v in served.module.state_dict().items()
             if not k.endswith((".sorted_keys", ".values", ".missing_value"))}
    g = torch.Generator().manual_seed(0)
    folder = tempfile.mkdtemp(dir=os.path.dirname(path))
    out = {}
    for case in ("new_100k_rows", "known_keys_updated"):
        tensors, count = dict(dense), 0
        for name in variables:
            frozen = served.module.get_submodule(name)
            if case == "new_100k_rows":
                keys = torch.randint(0, 1 << 62, (100_000 // len(variables),), generator=g)
            else:
                keys = frozen.sorted_keys[frozen.sorted_keys != _SENTINEL].clone()
            tensors[f"{name}.keys"] = keys
            tensors[f"{name}.values"] = torch.randn(keys.shape[0], frozen.values.shape[1], generator=g)
            count += keys.shape[0]
        manifest = os.path.join(folder, f"{case}.json")
        write_with_manifest(os.path.join(folder, f"{case}.safetensors"), manifest, lambda tmp: save_file(tensors, tmp),
                            {"format": FORMAT, "step": served.step + 1, "after": served.step, "variables": variables})
        times = []
        for _ in range(repeats):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CompiledFallbackWarning)
                start = time.perf_counter()
                updated = apply_delta(served, manifest)
                times.append(time.perf_counter() - start)
        out[case] = {"rows": count, "variables": len(variables), "seconds": statistics.median(times),
                     "scored_by": "compiled" if updated.compiled is not None else "traced (fell back)"}
    shutil.rmtree(folder, ignore_errors=True)
    return out


# -- report ---------------------------------------------------------------------------------------

def verdicts(results: dict, clients: int) -> list[dict]:
    """Each target against each variant's numbers."""
    out = []
    for variant in VARIANTS:
        ip = results["in_process"][variant][f"threads_{SERVER_THREADS}"]["1"]["columns"]["p50_ms"]
        out.append({"variant": variant, "target": "in process, 1 row: served(columns) p50 <= 0.5 ms",
                    "value": ip, "met": ip <= TARGETS["in_process_1_row_ms"]})
        out += http_verdicts(results, variant, clients, PROTOCOLS)
    return out


def http_verdicts(results: dict, variant: str, clients: int, protocols: tuple) -> list[dict]:
    """The HTTP targets against a variant's numbers over `protocols`."""
    out = []
    for protocol in protocols:
        one = results["http"][variant][protocol]["1"]["1_client"]
        out.append({"variant": variant, "target": f"HTTP {protocol}, 1 row: p50 <= 2 ms, p99 <= 4 ms",
                    "value": [one["p50_ms"], one["p99_ms"]],
                    "met": one["p50_ms"] <= TARGETS["http_1_row_p50_ms"] and
                    one["p99_ms"] <= TARGETS["http_1_row_p99_ms"]})
        for n, key in ((1, "clients_8_1_row_rows_per_s"), (64, "clients_8_64_rows_rows_per_s")):
            rate = results["http"][variant][protocol][str(n)][f"{clients}_clients"]["rows_per_s"]
            out.append({"variant": variant, "target": f"HTTP {protocol}, {clients} clients x {n} row(s): "
                        f">= {TARGETS[key]:,.0f} rows/s", "value": rate, "met": rate >= TARGETS[key]})
    return out


def grpc_verdicts(results: dict, clients: int) -> list[dict]:
    """The gRPC targets against the compiled variant's gRPC numbers."""
    grpc = results["grpc"]
    one = grpc["1"]["1_client"]
    out = [{"variant": "compiled", "target": f"gRPC, 1 row: p50 <= {TARGETS['grpc_1_row_p50_ms']:g} ms, "
            f"p99 <= {TARGETS['grpc_1_row_p99_ms']:g} ms", "value": [one["p50_ms"], one["p99_ms"]],
            "met": one["p50_ms"] <= TARGETS["grpc_1_row_p50_ms"] and one["p99_ms"] <= TARGETS["grpc_1_row_p99_ms"]}]
    for n in HTTP_ROWS:
        key, rate = _grpc_rate_target(n), grpc[str(n)][f"{clients}_clients"]["rows_per_s"]
        out.append({"variant": "compiled", "target": f"gRPC, {clients} clients x {n} row(s): >= {TARGETS[key]:,.0f} "
                    "rows/s", "value": rate, "met": rate >= TARGETS[key]})
    return out


def _grpc_rate_target(n: int) -> str:
    return "grpc_clients_8_1_row_rows_per_s" if n == 1 else "grpc_clients_8_64_rows_rows_per_s"


def table(results: dict, clients: int) -> list[list]:
    rows = []
    for variant in VARIANTS:
        ip = results["in_process"][variant][f"threads_{SERVER_THREADS}"]
        for n in IN_PROCESS_ROWS:
            for kind, label in (("columns", "in process, columns"), ("raw_batch", "in process, raw batch")):
                e = ip[str(n)][kind]
                target, met = "", ""
                if n == 1 and kind == "columns":
                    target, met = "p50 <= 0.5", _mark(e["p50_ms"] <= TARGETS["in_process_1_row_ms"])
                rows.append([variant, label, n, 1, f"{e['p50_ms']:.3f}", f"{e['p99_ms']:.3f}",
                             f"{n / e['p50_ms'] * 1e3:,.0f}", target, met])
        if "http" in results:  # not with --peer-only
            rows += http_table(results, variant, clients)
    if "grpc" in results:
        rows += grpc_table(results, clients)
    return rows


def _mark(ok: bool) -> str:
    return "met" if ok else "MISSED"


def http_table(results: dict, variant: str, clients: int) -> list[list]:
    """The table's rows of a variant's HTTP measurements (the protocols measured)."""
    rows, http = [], results["http"][variant]
    f = http["floor_get_live"]
    rows.append([variant, "HTTP GET /v2/health/live", 0, 1, f"{f['p50_ms']:.3f}", f"{f['p99_ms']:.3f}", "", "", ""])
    for protocol in [p for p in PROTOCOLS if p in http]:
        for n in HTTP_ROWS:
            one, many = http[protocol][str(n)]["1_client"], http[protocol][str(n)][f"{clients}_clients"]
            target, met = "", ""
            if n == 1:
                target = "p50 <= 2, p99 <= 4"
                met = _mark(one["p50_ms"] <= TARGETS["http_1_row_p50_ms"] and
                            one["p99_ms"] <= TARGETS["http_1_row_p99_ms"])
            rows.append([variant, f"HTTP {protocol}", n, 1, f"{one['p50_ms']:.2f}", f"{one['p99_ms']:.2f}",
                         f"{n / one['p50_ms'] * 1e3:,.0f}", target, met])
            key = "clients_8_1_row_rows_per_s" if n == 1 else "clients_8_64_rows_rows_per_s"
            rows.append([variant, f"HTTP {protocol}", n, clients, f"{many['p50_ms']:.2f}", f"{many['p99_ms']:.2f}",
                         f"{many['rows_per_s']:,.0f}", f">= {TARGETS[key]:,.0f} rows/s",
                         _mark(many["rows_per_s"] >= TARGETS[key])])
    return rows


def grpc_table(results: dict, clients: int) -> list[list]:
    """The table's rows of the gRPC measurements (compiled)."""
    rows, grpc = [], results["grpc"]
    for n in HTTP_ROWS:
        one, many = grpc[str(n)]["1_client"], grpc[str(n)][f"{clients}_clients"]
        target, met = "", ""
        if n == 1:
            target = f"p50 <= {TARGETS['grpc_1_row_p50_ms']:g}, p99 <= {TARGETS['grpc_1_row_p99_ms']:g}"
            met = _mark(one["p50_ms"] <= TARGETS["grpc_1_row_p50_ms"] and one["p99_ms"] <= TARGETS["grpc_1_row_p99_ms"])
        rows.append(["compiled", "gRPC ModelInfer (raw)", n, 1, f"{one['p50_ms']:.2f}", f"{one['p99_ms']:.2f}",
                     f"{n / one['p50_ms'] * 1e3:,.0f}", target, met])
        key = _grpc_rate_target(n)
        rows.append(["compiled", "gRPC ModelInfer (raw)", n, clients, f"{many['p50_ms']:.2f}", f"{many['p99_ms']:.2f}",
                     f"{many['rows_per_s']:,.0f}", f">= {TARGETS[key]:,.0f} rows/s",
                     _mark(many["rows_per_s"] >= TARGETS[key])])
    if "floor" in grpc:  # what gRPC itself allows here: an echo server, the same client
        rows.append(["echo", "gRPC floor: prebuilt replies", 1, clients, "", "",
                     f"{grpc['floor']['requests_per_s']:,.0f}", "", ""])
    return rows


def plot(results: dict, clients: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"traced": "tab:gray", "compiled": "tab:blue"}
    peer = results.get("peer_onnxruntime")
    wide = 4 * ("grpc" in results)  # gRPC's groups beside HTTP's
    fig, axes = plt.subplots(1, 3 + (peer is not None), figsize=(15 + wide + 5 * (peer is not None), 4.2),
                             width_ratios=[1, 1 + wide / 10, 1 + wide / 10] + [1] * (peer is not None))
    left, middle, right = axes[:3]
    if peer is not None:
        serving_peer.plot_panel(axes[3], peer)
    ip = {v: results["in_process"][v][f"threads_{SERVER_THREADS}"] for v in VARIANTS}
    for k, v in enumerate(VARIANTS):
        xs = [i + 0.4 * k for i in range(len(IN_PROCESS_ROWS))]
        left.bar(xs, [ip[v][str(n)]["columns"]["p50_ms"] for n in IN_PROCESS_ROWS], 0.4, color=colors[v], label=v)
        left.scatter(xs, [ip[v][str(n)]["raw_batch"]["p50_ms"] for n in IN_PROCESS_ROWS], color="black", marker="_",
                     s=200, zorder=3, label="model only (raw batch)" if k else None)
    left.axhline(TARGETS["in_process_1_row_ms"], color="tab:red", ls="--", lw=1, label="target, 1 row")
    left.set_xticks([i + 0.2 for i in range(len(IN_PROCESS_ROWS))], [f"{n} rows" for n in IN_PROCESS_ROWS])
    left.set_yscale("log")
    left.set_ylim(top=left.get_ylim()[1] * 6)  # room for the legend
    left.set_ylabel("ms per call, p50")
    left.set_title(f"in process, served(columns), {SERVER_THREADS} torch thread", fontsize=10)
    left.legend(fontsize=7, loc="upper left", ncol=2)
    serving_panels(middle, right, results, clients, VARIANTS, PROTOCOLS)
    fig.suptitle(f"deeprec serve, DLRM (EmbeddingVariables): ExportedProgram vs AOTInductor package - {cpu_line()}",
                 fontsize=10)
    save_figure(fig, "serving")


def serving_panels(middle, right, results: dict, clients: int, variants: tuple, protocols: tuple) -> None:
    """HTTP (`protocols`) and, where measured, gRPC (compiled only), per row count: 1 client's p50 (bars)
    and p99 (marks) in `middle`, `clients` clients' rows/s in `right`; each group's targets over it."""
    colors = {"traced": "tab:gray", "compiled": "tab:blue"}
    kinds = (*protocols, *(["grpc"] if "grpc" in results else []))
    groups = [(p, n) for n in HTTP_ROWS for p in kinds]
    labels = [f"{'gRPC' if p == 'grpc' else p}\n{n} row{'s' if n > 1 else ''}" for p, n in groups]
    width = 0.8 / len(variants)

    def entry(variant: str, protocol: str, n: int) -> dict | None:
        if protocol == "grpc":
            return results["grpc"][str(n)] if variant == "compiled" else None
        return results["http"][variant][protocol][str(n)]

    for k, v in enumerate(variants):
        found = [(i + width * k, e) for i, (p, n) in enumerate(groups) if (e := entry(v, p, n)) is not None]
        xs = [x for x, _ in found]
        middle.bar(xs, [e["1_client"]["p50_ms"] for _, e in found], width, color=colors[v], label=f"{v} p50")
        middle.scatter(xs, [e["1_client"]["p99_ms"] for _, e in found], color=colors[v], edgecolor="black",
                       marker="v", zorder=3, label=f"{v} p99")
        right.bar(xs, [e[f"{clients}_clients"]["rows_per_s"] for _, e in found], width, color=colors[v], label=v)
    for i, (p, n) in enumerate(groups):  # each group's targets, over its bars
        span = (i - width / 2, i + width * (len(variants) - 0.5))
        if n == 1:
            key = "grpc_1_row" if p == "grpc" else "http_1_row"
            middle.hlines(TARGETS[f"{key}_p50_ms"], *span, color="tab:red", ls="--", lw=1,
                          label="target p50 (1 row)" if i == 0 else None)
            middle.hlines(TARGETS[f"{key}_p99_ms"], *span, color="tab:red", ls=":", lw=1,
                          label="target p99 (1 row)" if i == 0 else None)
        key = _grpc_rate_target(n) if p == "grpc" else ("clients_8_1_row_rows_per_s" if n == 1 else
                                                        "clients_8_64_rows_rows_per_s")
        right.hlines(TARGETS[key], *span, color="tab:red", ls="--", lw=1, label="targets" if i == 0 else None)
    middle.set_ylim(top=middle.get_ylim()[1] * 1.35)
    middle.set_ylabel("ms per request")
    right.set_yscale("log")
    right.set_ylim(top=right.get_ylim()[1] * 4)
    right.set_ylabel("rows/s")
    over = "HTTP and gRPC" if "grpc" in results else "HTTP"
    middle.set_title(f"{over}, 1 client", fontsize=10)
    right.set_title(f"{over}, {clients} concurrent clients", fontsize=10)
    for ax in (middle, right):
        ax.set_xticks([i + width * (len(variants) - 1) / 2 for i in range(len(groups))], labels, fontsize=8)
        ax.legend(fontsize=7, loc="upper left", ncol=2)


def main() -> None:
    from deeprec.choices import ALLOCATORS
    from deeprec.serving.allocator import loaded, run_with

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300,
                        help="requests per latency measurement (throughput: clients x max(this/clients, 50))")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--export", help="reuse this export (with its compiled CPU package) instead of training one")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled server run")
    parser.add_argument("--before", metavar="DIR", help="also serve the compiled export with another checkout's "
                        "deeprec (its extension built), in the same run: a before/after table (with "
                        "--grpc-only: gRPC's, 3 alternating rounds)")
    parser.add_argument("--peer-only", action="store_true", help="only the in-process measurement and the ONNX "
                        "Runtime peer (bench/serving_peer.py), no HTTP servers: bench/results/serving_peer.json")
    parser.add_argument("--grpc-only", action="store_true", help="only the compiled server: gRPC, and HTTP v2 (JSON, "
                        "binary) beside it (no in process, peer, traced, profile): bench/results/serving_grpc.json")
    parser.add_argument("--allocator", default=os.environ.get("DEEPREC_SERVE_ALLOCATOR", "auto"), choices=ALLOCATORS,
                        help="this process's C allocator, as `deeprec serve --allocator` (its default: the "
                             "in-process rows measure what the server runs); the servers take the same")
    args = parser.parse_args()
    run_with(args.allocator, sys.argv[1:], [os.path.abspath(__file__)])  # mimalloc: re-executes once

    import torch

    import deeprec as dr
    from deeprec.cli import sample_path
    from deeprec.serving.repository import model_name

    warnings.simplefilter("ignore", UserWarning)  # the traced copy's fallback warning, torch's notes
    warnings.simplefilter("ignore", FutureWarning)
    default_threads = torch.get_num_threads()
    began = time.perf_counter()
    results = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "requests": args.requests,
               "clients": args.clients, "cpu": cpu_line(), "load_average_at_start": os.getloadavg(),
               "allocator": loaded(),  # of this process: the in-process rows, the clients and the peer
               "targets": TARGETS,
               "server": {"threads": SERVER_THREADS, "max_batch": 256, "max_wait_ms": 0.0,
                          "http_parser": _module_or("httptools", "h11 (httptools not installed)"),
                          "event_loop": _module_or("uvloop", "asyncio (uvloop not installed)")},
               "client": "minimal HTTP/1.1 keep-alive client: a blocking socket (1 client), asyncio streams "
                         "(several), bodies pre-encoded with orjson; in the same 2 cores as the server"}
    with tempfile.TemporaryDirectory() as folder:
        print("training and exporting (with the compiled package) ...", flush=True)
        path = os.path.abspath(args.export or exported_model(folder))  # --before's server runs elsewhere
        paths = {"compiled": path, "traced": traced_copy(path, folder)}
        took, mark = {"export": time.perf_counter() - began}, time.perf_counter()

        def lap(name: str) -> None:
            nonlocal mark
            took[name], mark = time.perf_counter() - mark, time.perf_counter()

        served = dr.serving.load(path)
        if served.compiled is None:
            raise SystemExit(f"{path}: not scored by its compiled package: {served.compiled_reason}")
        rows = sample_rows(sample_path("criteo_sample.txt"), served.schema)
        if args.grpc_only:
            return _grpc_only(results, args, path, served, rows, folder, took, began)

        print("in process ...", flush=True)
        threads = sorted({1, default_threads})
        results["in_process"] = in_process(served, rows, args.requests, threads)
        results["in_process_threads"] = {"measured": threads, "default": default_threads,
                                         "table_and_targets": SERVER_THREADS}
        stages = None if args.peer_only else handler_stages(served, rows, max(100, args.requests // 2))
        torch.set_num_threads(default_threads)
        lap("in_process")
        print("in process, ONNX Runtime peer (bench/serving_peer.py) ...", flush=True)
        results["peer_onnxruntime"] = serving_peer.run(served, lambda n: rows_of(rows, n), args.requests,
                                                       latency_stats, folder, SERVER_THREADS)
        torch.set_num_threads(default_threads)
        lap("peer_onnxruntime")
        if args.peer_only:
            return _peer_only_report(results, took, began)

        results["http"] = {}
        for variant in VARIANTS:
            print(f"HTTP, {variant} ...", flush=True)
            server = Server(paths[variant], os.path.join(folder, f"{variant}.log"), name=model_name(path),
                            grpc=variant == "compiled")
            try:
                results["http"][variant] = measure_http(server, served, rows, args.requests, args.clients)
                if variant == "compiled":  # http.client's own cost, beside the lean client
                    one = bodies(served, rows, 1)["v1"]
                    results["stdlib_http_client_vs_lean"] = {
                        "get_live": stdlib_client_overhead(server.port, "/v2/health/live", None, {}, args.requests),
                        "v1_1_row": stdlib_client_overhead(server.port, *one, args.requests)}
                    lap(f"http_{variant}")
                    print("gRPC, compiled ...", flush=True)
                    results["grpc"] = measure_grpc(server, served, rows, args.requests, args.clients)
                    lap("grpc_compiled")
            finally:
                server.stop()
            if variant != "compiled":
                lap(f"http_{variant}")

        if args.before:
            print(f"HTTP, compiled, served by {args.before} ...", flush=True)
            server = Server(path, os.path.join(folder, "before.log"), source=os.path.abspath(args.before),
                            name=model_name(path))
            try:
                results["http_before"] = {"source": args.before, "commit": _commit(args.before),
                                          **measure_http(server, served, rows, args.requests, args.clients)}
            finally:
                server.stop()
            lap("http_before")

        where = {"handler_stages_in_process_ms": stages,
                 "http_1_client_split_ms": _http_split(results, stages),
                 "cpu_per_request_under_load": _cpu_under_load(results, args.clients)}
        if not args.no_profile:
            print("profiling the compiled server's event loop ...", flush=True)
            where["server_event_loop_profile"] = profile_server(path, served, rows, args.requests, args.clients,
                                                                folder)
            lap("profile")
        results["where_time_goes"] = where
        print("online deltas ...", flush=True)
        results["delta_apply"] = delta_apply(path)
        lap("delta_apply")
    results["phase_seconds"] = took
    results["verdicts"] = verdicts(results, args.clients) + grpc_verdicts(results, args.clients) + [
        {"variant": "compiled", **v} for v in results["peer_onnxruntime"].get("verdicts", [])]  # the peer's: ratios
    results["seconds"] = time.perf_counter() - began

    print_table(f"deeprec serve, DLRM (EmbeddingVariables), loopback, client sharing the cores - {cpu_line()}; "
                f"server --threads {SERVER_THREADS}, in process {SERVER_THREADS} torch thread",
                ["variant", "load", "rows", "clients", "p50 ms", "p99 ms", "rows/s", "target", ""],
                table(results, args.clients))
    serving_peer.print_table(results["peer_onnxruntime"])
    _print_where(results, args.clients)
    if "http_before" in results:
        _print_before_after(results, args.clients)
    print("saved", save_json("serving", results))
    plot(results, args.clients)
    print(f"{results['seconds']:.0f} s in all")


def _grpc_only(results: dict, args, path: str, served, rows: dict, folder: str, took: dict, began: float) -> None:
    """--grpc-only: the compiled export's server (with --grpc-port 0): HTTP v2 (JSON, binary) and gRPC, at 1
    and 64 rows, 1 and `clients` clients; in bench/results/serving_grpc.json and .png (serving.json keeps
    the full run's)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from deeprec.serving.repository import model_name

    mark = time.perf_counter()
    print("HTTP v2 and gRPC, compiled ...", flush=True)
    server = Server(path, os.path.join(folder, "compiled.log"), name=model_name(path), grpc=True)
    try:
        results["http"] = {"compiled": measure_http(server, served, rows, args.requests, args.clients, V2)}
        took["http_compiled"], mark = time.perf_counter() - mark, time.perf_counter()
        results["grpc"] = measure_grpc(server, served, rows, args.requests, args.clients)
        took["grpc_compiled"] = time.perf_counter() - mark
    finally:
        server.stop()
    if args.before:
        mark = time.perf_counter()
        results["grpc_before_after"] = grpc_before_after(path, served, rows, args.before, args.clients, folder)
        took["grpc_before_after"] = time.perf_counter() - mark
    results["phase_seconds"] = took
    results["verdicts"] = http_verdicts(results, "compiled", args.clients, V2) + grpc_verdicts(results, args.clients)
    results["seconds"] = time.perf_counter() - began
    print_table(f"deeprec serve, DLRM (EmbeddingVariables), compiled, HTTP v2 and gRPC, loopback, client sharing the "
                f"cores - {cpu_line()}; server --threads {SERVER_THREADS}",
                ["variant", "load", "rows", "clients", "p50 ms", "p99 ms", "rows/s", "target", ""],
                http_table(results, "compiled", args.clients) + grpc_table(results, args.clients))
    print("saved", save_json("serving_grpc", results))
    fig, (middle, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    serving_panels(middle, right, results, args.clients, ("compiled",), V2)
    fig.suptitle(f"deeprec serve, DLRM (EmbeddingVariables), AOTInductor package: HTTP v2 and gRPC - {cpu_line()}",
                 fontsize=10)
    save_figure(fig, "serving_grpc")
    print(f"{results['seconds']:.0f} s in all")


def grpc_before_after(path: str, served, rows: dict, source: str, clients: int, folder: str, rounds: int = 3) -> dict:
    """--grpc-only --before DIR: `clients` gRPC clients at 1 and 64 rows against the compiled export served by
    DIR's deeprec and by this one, alternating over `rounds` rounds (each a server started anew): rows/s and
    server CPU a request, medians and ratios."""
    from deeprec.serving.repository import model_name

    name, runs = model_name(path), {}
    reqs = {n: [serving_grpc.request_bytes(name, raw_tensors(served, rows_of(rows, n, 17 * i))) for i in range(clients)]
            for n in HTTP_ROWS}
    print(f"gRPC before ({source}) and after, {rounds} alternating rounds ...", flush=True)
    for _ in range(rounds):
        for label, src in (("before", os.path.abspath(source)), ("after", None)):
            server = Server(path, os.path.join(folder, f"grpc_{label}.log"), source=src, name=name, grpc=True)
            try:
                for n, r in reqs.items():
                    total = 400 * clients if n == 1 else 100 * clients
                    asyncio.run(serving_grpc.many_clients(server.grpc, r, n, total // 8, f"gRPC {label}"))  # warm
                    cpu = server.cpu_seconds()
                    elapsed, _, done = asyncio.run(serving_grpc.many_clients(server.grpc, r, n, total, f"gRPC {label}"))
                    runs.setdefault(label, {}).setdefault(str(n), []).append(
                        {"rows_per_s": done * n / elapsed, "server_cpu_ms_per_request": (server.cpu_seconds() - cpu) / done * 1e3})
            finally:
                server.stop()
    out = {"source": source, "commit": _commit(source), "rounds": runs, "clients": clients}
    table_rows = []
    for n in map(str, HTTP_ROWS):
        med = {label: {k: statistics.median(r[k] for r in runs[label][n]) for k in runs[label][n][0]} for label in runs}
        out[n] = {**med, "ratio_rows_per_s": med["after"]["rows_per_s"] / med["before"]["rows_per_s"]}
        table_rows.append([n, f"{med['before']['rows_per_s']:,.0f}", f"{med['after']['rows_per_s']:,.0f}",
                           f"{out[n]['ratio_rows_per_s']:.2f}x", f"{med['before']['server_cpu_ms_per_request']:.2f}",
                           f"{med['after']['server_cpu_ms_per_request']:.2f}"])
    print_table(f"gRPC, {clients} clients, before ({out['commit'][:60]}) and after, medians of {rounds} alternating "
                f"rounds - {cpu_line()}", ["rows", "rows/s before", "after", "ratio", "server CPU ms/req before",
                                           "after"], table_rows)
    return out


def _peer_only_report(results: dict, took: dict, began: float) -> None:
    """--peer-only: the in-process rows and the peer's, in bench/results/serving_peer.json and .png
    (serving.json keeps the full run's)."""
    results["phase_seconds"], results["seconds"] = took, time.perf_counter() - began
    print_table(f"deeprec in process, DLRM (EmbeddingVariables) - {cpu_line()}; {SERVER_THREADS} torch thread",
                ["variant", "load", "rows", "clients", "p50 ms", "p99 ms", "rows/s", "target", ""],
                table(results, results["clients"]))
    serving_peer.print_table(results["peer_onnxruntime"])
    print("saved", save_json("serving_peer", results))
    if "skipped" not in results["peer_onnxruntime"]:
        serving_peer.plot(results["peer_onnxruntime"])
    print(f"{results['seconds']:.0f} s in all")


def _commit(source: str) -> str:
    found = subprocess.run(["git", "-C", source, "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    return found.stdout.strip()[:100] or "?"


def _print_before_after(results: dict, clients: int) -> None:
    """The compiled export served by this checkout and by --before's, per protocol and rows."""
    before, after, rows = results["http_before"], results["http"]["compiled"], []
    for protocol in PROTOCOLS:
        for n in HTTP_ROWS:
            b, a = before[protocol][str(n)], after[protocol][str(n)]
            many_b, many_a = b[f"{clients}_clients"], a[f"{clients}_clients"]
            rows.append([protocol, n, f"{b['1_client']['p50_ms']:.2f}", f"{a['1_client']['p50_ms']:.2f}",
                         f"{many_b['rows_per_s']:,.0f}", f"{many_a['rows_per_s']:,.0f}",
                         f"{many_a['rows_per_s'] / many_b['rows_per_s']:.2f}",
                         f"{many_b['server_cpu_ms_per_request']:.2f}", f"{many_a['server_cpu_ms_per_request']:.2f}"])
    print_table(f"before ({before['commit']}) and after, compiled, HTTP",
                ["protocol", "rows", "p50 ms before", "p50 ms after", f"{clients} clients rows/s before", "after",
                 "ratio", "server CPU ms/req before", "after"], rows)


def _module_or(name: str, otherwise: str) -> str:
    import importlib.util

    return name if importlib.util.find_spec(name) is not None else otherwise


def _http_split(results: dict, stages: dict) -> dict:
    """Each 1-client HTTP request (means, ms) as: the handler's work (its stages, timed in process);
    the rest of the server's time for it (its latency histogram: from the route's start to the answer
    built, less the handler's work: Starlette, the batcher, the hop to the scoring thread and back, a
    model call slower there than in a hot loop); and HTTP (the client's time less the server's:
    uvicorn, h11, the sockets, the client). `http_floor`: an empty GET through the same server and
    client (p50), for scale."""
    out = {}
    for variant in VARIANTS:
        floor = results["http"][variant]["floor_get_live"]["p50_ms"]
        for protocol in PROTOCOLS:
            for n in HTTP_ROWS:
                one = results["http"][variant][protocol][str(n)]["1_client"]
                handler, server = stages[variant][protocol][str(n)]["total"], one["server_handler_mean_ms"]
                out.setdefault(variant, {})[f"{protocol} {n} rows"] = {
                    "client_mean": one["mean_ms"], "server_mean": server, "handler_in_process": handler,
                    "server_around_handler": server - handler, "http_and_client": one["mean_ms"] - server,
                    "http_floor": floor}
    return out


def _cpu_under_load(results: dict, clients: int) -> dict:
    keys = ("server_cpu_ms_per_request", "client_cpu_ms_per_request", "rows_per_model_call",
            "cores_busy_with_server_and_client")
    return {v: {f"{p} {n} rows": {k: results["http"][v][p][str(n)][f"{clients}_clients"][k] for k in keys}
                for p in PROTOCOLS for n in HTTP_ROWS} for v in VARIANTS}


def _print_where(results: dict, clients: int) -> None:
    where = results["where_time_goes"]
    rows = []
    for variant in VARIANTS:
        for protocol in PROTOCOLS:
            for n in HTTP_ROWS:
                s = where["handler_stages_in_process_ms"][variant][protocol][str(n)]
                h = where["http_1_client_split_ms"][variant][f"{protocol} {n} rows"]
                c = where["cpu_per_request_under_load"][variant][f"{protocol} {n} rows"]
                rows.append([variant, protocol, n, f"{s['decode']:.3f}", f"{s['convert']:.3f}", f"{s['score']:.3f}",
                             f"{s['program']:.3f}", f"{s['encode']:.3f}", f"{h['handler_in_process']:.3f}",
                             f"{h['server_around_handler']:.3f}", f"{h['http_and_client']:.3f}",
                             f"{h['client_mean']:.3f}", f"{c['server_cpu_ms_per_request']:.2f}",
                             f"{c['client_cpu_ms_per_request']:.2f}", f"{c['rows_per_model_call'] or 0:.1f}"])
    print_table("where the time goes, 1 client (ms, means): the handler's stages in process; an HTTP request: "
                "the handler, the rest of the server's time (Starlette, batcher, scoring thread hop), HTTP "
                f"(uvicorn, h11, sockets, client); CPU per request with {clients} clients",
                ["variant", "protocol", "rows", "decode", "convert", "score", "of it program", "encode", "handler",
                 "server, around it", "HTTP + client", "HTTP mean", "server CPU ms/req", "client CPU ms/req",
                 "rows/model call"], rows)
    for load, prof in where.get("server_event_loop_profile", {}).items():
        print(f"compiled server's event-loop thread CPU, {load} (shares, under cProfile): "
              + ", ".join(f"{k} {v:.0%}" for k, v in list(prof["share_by_stage"].items())[:9]))
    for case, d in results["delta_apply"].items():
        print(f"delta {case}: {d['rows']:,} rows over {d['variables']} EVs, {d['seconds'] * 1e3:.0f} ms, then scored "
              f"by {d['scored_by']}")


if __name__ == "__main__":
    main()
