"""gRPC beside HTTP in bench/serving.py: `deeprec serve --grpc-port 0` (the compiled variant's server),
the Open Inference Protocol's `inference.GRPCInferenceService/ModelInfer`, on loopback, the client in
this process (sharing the cores with the server, as the HTTP client does).

The client is lean, as bench/serving.py's HTTP client: each ModelInferRequest is serialized once, its
inputs in raw_input_contents (tritonclient.grpc's way; the same little-endian bytes as the HTTP v2 binary
body), and the method is called with grpc's low-level API on raw bytes (`channel.unary_unary(METHOD)`
with no serializers: no protobuf on the request path). 1 client: a blocking call on a sync channel;
several: grpc.aio, one channel (its own connection: a local subchannel pool) and one loop per client,
concurrent on one event loop.

Each reply is checked: its status (a status other than OK raises grpc.RpcError), and its size. The
first reply of each request is parsed (deeprec.serving.proto's ModelInferResponse: every output has as
many FP32 scores as the request has rows); the rest must have that reply's length in bytes, which a reply
with another number of scores cannot have (4 bytes a score; the varints around them differ by less).
Before timing, gRPC's scores are checked to equal HTTP v2's (JSON and binary answers) for the same rows,
exactly (`check_equal`).
"""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import numpy as np

METHOD = "/inference.GRPCInferenceService/ModelInfer"
# a channel of its own per client (grpc shares a connection between channels to one target otherwise)
OPTIONS = [("grpc.use_local_subchannel_pool", 1)]
CLIENT = ("grpc low-level API on pre-serialized ModelInferRequest bytes (raw_input_contents), no serializers: "
          "a sync channel (1 client), grpc.aio with one channel and loop per client (several); each reply's "
          "status checked, the first parsed (scores per output = rows), the rest by length")


def request_bytes(model: str, tensors: list[tuple[str, str, int, bytes]]) -> bytes:
    """A serialized ModelInferRequest for `model` of `tensors` ((name, datatype, rows, raw little-endian
    values), in raw_input_contents; no requested outputs: every output, raw FP32, as tritonclient asks)."""
    from deeprec.serving.proto import grpc_service_pb2 as pb

    request = pb.ModelInferRequest(model_name=model)
    for name, datatype, n, blob in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=[n])
        request.raw_input_contents.append(blob)
    return request.SerializeToString()


def scores(reply: bytes) -> dict[str, np.ndarray]:
    """{output: its FP32 scores} of a serialized ModelInferResponse."""
    from deeprec.serving.proto import grpc_service_pb2 as pb

    response = pb.ModelInferResponse.FromString(reply)
    if len(response.raw_output_contents) != len(response.outputs):
        raise RuntimeError(f"{len(response.outputs)} outputs, {len(response.raw_output_contents)} raw_output_contents")
    out = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents):
        if tensor.datatype != "FP32" or len(raw) != 4 * int(np.prod(tensor.shape)):
            raise RuntimeError(f"output {tensor.name!r}: {tensor.datatype} {list(tensor.shape)}, {len(raw)} bytes")
        out[tensor.name] = np.frombuffer(raw, "<f4")
    return out


def reply_size(reply: bytes, rows: int, what: str) -> int:
    """The reply's length, once it is parsed and every output found to have `rows` scores."""
    for name, values in scores(reply).items():
        if len(values) != rows:
            raise RuntimeError(f"{what}: output {name!r} has {len(values)} scores for {rows} rows")
    return len(reply)


def _wrong(reply: bytes, size: int, rows: int, what: str) -> None:
    reply_size(reply, rows, what)  # says which output is wrong, if one is
    raise RuntimeError(f"{what}: a reply of {len(reply)} bytes, the first was {size}")


def check_equal(target: str, request: bytes, http: dict[str, bytes], rows: int) -> dict:
    """gRPC's scores for `request` against HTTP v2's answers for the same rows ({"v2-json": body,
    "v2-binary": body}), exactly (FP32 bit for bit); raises if they differ."""
    with grpc.insecure_channel(target, options=OPTIONS) as channel:
        got = scores(channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)(request))
    out = {"rows": rows, "outputs": list(got)}
    for protocol, body in http.items():
        if protocol == "v2-binary":  # a JSON header, then the outputs' binary values in its order
            header, end = json.JSONDecoder().raw_decode(body.decode("latin-1"))
            theirs, at = {}, end
            for tensor in header["outputs"]:
                size = tensor["parameters"]["binary_data_size"]
                theirs[tensor["name"]], at = np.frombuffer(body[at:at + size], "<f4"), at + size
        else:
            theirs = {t["name"]: np.array(t["data"], "<f4") for t in json.loads(body)["outputs"]}
        if set(theirs) != set(got):
            raise RuntimeError(f"gRPC outputs {sorted(got)}, HTTP {protocol}'s {sorted(theirs)}")
        for name, values in got.items():
            if len(values) != rows or values.tobytes() != theirs[name].tobytes():
                worst = np.max(np.abs(values.astype(np.float64) - theirs[name])) if len(values) == len(theirs[name]) \
                    else "sizes differ"
                raise RuntimeError(f"{rows} rows, output {name!r}: gRPC's scores differ from HTTP {protocol}'s "
                                   f"(max |diff| {worst})")
        out[f"equal_to_http_{protocol}"] = True
    return out


def one_client(target: str, request: bytes, rows: int, count: int, what: str, warmup: int = 10) -> list[float]:
    """`count` timings (seconds) of a blocking ModelInfer call on one channel."""
    with grpc.insecure_channel(target, options=OPTIONS) as channel:
        call = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
        size = reply_size(call(request), rows, what)
        for _ in range(warmup):
            call(request)
        times = []
        for _ in range(count):
            start = time.perf_counter()
            reply = call(request)
            times.append(time.perf_counter() - start)
            if len(reply) != size:
                _wrong(reply, size, rows, what)
    return times


async def _client_loop(call, request: bytes, size: int, rows: int, count: int, times: list | None,
                       what: str) -> None:
    for _ in range(count):
        start = time.perf_counter()
        reply = await call(request)
        if times is not None:
            times.append(time.perf_counter() - start)
        if len(reply) != size:
            _wrong(reply, size, rows, what)


async def many_clients(target: str, requests: list[bytes], rows: int, total: int, what: str,
                       warmup: int = 10) -> tuple[float, list, int]:
    """len(requests) concurrent clients (a channel and a loop each), about `total` calls in all:
    (seconds, per-call timings, calls)."""
    channels = [grpc.aio.insecure_channel(target, options=OPTIONS) for _ in requests]
    try:
        calls = [c.unary_unary(METHOD, request_serializer=None, response_deserializer=None) for c in channels]
        sizes = [reply_size(await call(req), rows, what) for call, req in zip(calls, requests)]
        clients = list(zip(calls, requests, sizes))
        await asyncio.gather(*(_client_loop(c, r, s, rows, warmup, None, what) for c, r, s in clients))
        per, times = max(1, total // len(requests)), []
        start = time.perf_counter()
        await asyncio.gather(*(_client_loop(c, r, s, rows, per, times, what) for c, r, s in clients))
        return time.perf_counter() - start, times, per * len(requests)
    finally:
        for channel in channels:
            await channel.close()


# The floor: a grpc.aio server (uvloop, as `deeprec serve`) in a process of its own that answers every
# ModelInfer with the same prebuilt reply bytes (the real server's reply to the request), no model, no
# decoding; measured with the same client. What gRPC itself costs here, client and server on 2 cores.
_ECHO = """
import sys, grpc, uvloop
reply = open(sys.argv[1], "rb").read()
async def main():
    async def infer(request, context):
        return reply
    handler = grpc.method_handlers_generic_handler("inference.GRPCInferenceService",
                                                   {"ModelInfer": grpc.unary_unary_rpc_method_handler(infer)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()
uvloop.run(main())
"""


def floor(target: str, requests: list[bytes], rows: int, total: int) -> dict:
    """8 (len(requests)) clients against the echo server answering the real server's reply at `target`:
    requests/s, the echo server's CPU per request (its process's, from /proc) and the clients' (this one's)."""
    import os
    import subprocess
    import sys
    import tempfile

    with grpc.insecure_channel(target, options=OPTIONS) as channel:
        reply = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)(requests[0])
    with tempfile.NamedTemporaryFile(suffix=".bin", delete=False) as f:
        f.write(reply)
        path = f.name
    echo = subprocess.Popen([sys.executable, "-c", _ECHO, path], stdout=subprocess.PIPE, text=True)
    try:
        address = f"127.0.0.1:{int(echo.stdout.readline())}"
        asyncio.run(many_clients(address, requests, rows, total // 4, "echo"))  # warm
        with open(f"/proc/{echo.pid}/stat") as f:
            before = f.read()
        client = time.process_time()
        elapsed, _, done = asyncio.run(many_clients(address, requests, rows, total, "echo"))
        client = time.process_time() - client
        with open(f"/proc/{echo.pid}/stat") as f:
            after = f.read()
    finally:
        echo.kill()
        echo.wait()
        os.remove(path)

    def cpu(stat: str) -> float:
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    return {"requests_per_s": done / elapsed, "server_cpu_ms_per_request": (cpu(after) - cpu(before)) / done * 1e3,
            "client_cpu_ms_per_request": client / done * 1e3,
            "requests": done, "what": "grpc.aio + uvloop answering prebuilt reply bytes (no model, no decoding), "
                                      "the same client"}
