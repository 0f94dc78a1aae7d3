"""deeprec serve --grpc-port: the Open Inference Protocol's gRPC service (KServe v2, Triton's), spoken by
the official client (tritonclient.grpc) against real servers on loopback: scores bitwise equal to HTTP
v2's on the same export and rows (raw_input_contents and typed contents, BYTES columns included), one
export and a repository of two, the same batches and /metrics as HTTP, the errors' statuses and HTTP's
messages, the token, the size limit; and the generated modules are what the .proto generates.

This process imports tritonclient.grpc, whose protobuf messages share the package `inference` with
deeprec's (serving/proto): the servers run in their own processes (one cannot load both)."""
import concurrent.futures
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading

import grpc
import httpx
import numpy as np
import pytest
import torch

import deeprec as dr

from test_serving import _din_export, _dlrm_export

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc  # noqa: E402  (tritonclient's own)
from tritonclient.utils import InferenceServerException  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO = "deeprec/serving/proto/grpc_service.proto"
TOKEN = "grpc-test-token"
TYPED = {"FP32": "fp32_contents", "INT64": "int64_contents", "BYTES": "bytes_contents"}


def _auth() -> dict:
    """The token's header (gRPC metadata keys are lower case); a new dict each call: tritonclient.http adds
    its own headers to the dict it is given."""
    return {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{name: (path, rows)}: a DLRM (dense FP32, string ids BYTES) and a DIN (int ids INT64, sequences BYTES),
    their traced programs (DEEPREC_EXPORT_COMPILE=0: request handling, not the compiled package)."""
    tmp = tmp_path_factory.mktemp("grpc-exports")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DEEPREC_EXPORT_COMPILE", "0")
        dlrm, dlrm_rows = _dlrm_export(tmp, rows=8)
    din_rows = {"user_id": [1, 2, 7], "item_id": [3, 4, 5], "category_id": [1, 2, 3],
                "hist_items": [[5, 6, 7], [8, 9], [1]], "hist_cats": [[1, 2, 3], [4, 5], []]}
    return {"dlrm": (dlrm, dlrm_rows), "din": (_din_export(tmp), din_rows)}


def _serve(args: list) -> tuple[subprocess.Popen, str, str]:
    """`deeprec serve ARGS` started; (process, HTTP host:port, gRPC host:port) once it printed both."""
    proc = subprocess.Popen([sys.executable, "-m", "deeprec", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    while not lines or not lines[-1].startswith("grpc listening on "):
        line = proc.stdout.readline()
        assert line, (lines, proc.stderr.read() if proc.poll() is not None else "")
        lines.append(line.strip())
    assert lines[0].startswith("listening on http://127.0.0.1:"), lines
    return proc, lines[0].split()[-1].removeprefix("http://"), lines[-1].split()[-1]


def _stopped(proc: subprocess.Popen) -> None:
    """Stops a server as an operator does (SIGTERM): it exits cleanly (its lifespan's end ran)."""
    proc.terminate()
    code, err = proc.wait(30), proc.stderr.read()
    assert code in (0, -signal.SIGTERM) and "Traceback" not in err, (code, err)


@pytest.fixture(scope="module")
def repository(exports, tmp_path_factory):
    """A model repository of both exports, served with a token; (http, grpc, {name: (served, rows)})."""
    repo = tmp_path_factory.mktemp("grpc-repo")
    for name, (path, _) in exports.items():
        shutil.copytree(path, repo / name)
    proc, http, address = _serve([str(repo), "--port", "0", "--grpc-port", "0", "--token", TOKEN])
    yield http, address, {name: (dr.serving.load(path), rows) for name, (path, rows) in exports.items()}
    _stopped(proc)


@pytest.fixture(scope="module")
def single(exports):
    """The DLRM export alone, no token, batches waiting 200 ms for company, bodies and messages <= 64 KiB."""
    path, rows = exports["dlrm"]
    proc, http, address = _serve([path, "--port", "0", "--grpc-port", "0", "--max-wait-ms", "200",
                                  "--max-body-bytes", "64KiB"])
    yield http, address, dr.serving.load(path), rows
    _stopped(proc)


def _rows(rows: dict, n: int) -> dict:
    return {k: v[:n] for k, v in rows.items()}


def _arrays(served, rows: dict) -> list:
    """(name, datatype, values) of each input, as the metadata types them: dense FP32 (None: NaN), int ids
    INT64, string ids and sequences BYTES (a sequence's ids joined by the column's separator)."""
    columns = {c.name: c for c in served.schema.columns}
    out = []
    for name, values in rows.items():
        c = columns[name]
        if c.kind == "dense":
            out.append((name, "FP32", np.array([np.nan if v is None else v for v in values], np.float32)))
        elif c.kind == "categorical" and c.dtype == "int":
            out.append((name, "INT64", np.array(values, np.int64)))
        else:
            text = [v if isinstance(v, str) else c.separator.join(map(str, v)) for v in values]
            out.append((name, "BYTES", np.array([t.encode() for t in text], dtype=object)))
    return out


def _inputs(client, arrays: list) -> list:
    """InferInputs of tritonclient.grpc (raw_input_contents) or .http (binary tensors) holding `arrays`."""
    return [client.InferInput(n, list(a.shape), k).set_data_from_numpy(a) for n, k, a in arrays]


def _typed(model: str, arrays: list, **fields) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest (tritonclient's own message) of typed contents: no raw_input_contents."""
    request = service_pb2.ModelInferRequest(model_name=model, **fields)
    for name, kind, values in arrays:
        tensor = request.inputs.add(name=name, datatype=kind, shape=[len(values)])
        getattr(tensor.contents, TYPED[kind]).extend(values.tolist())
    return request


def _scores(response) -> np.ndarray:
    assert [o.datatype for o in response.outputs] == ["FP32"]
    return np.frombuffer(response.raw_output_contents[0], "<f4")


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    """Bitwise equal float32 scores."""
    return got.dtype == want.dtype == np.float32 and torch.equal(torch.from_numpy(got.copy()),
                                                                 torch.from_numpy(want.copy()))


def _metric(http: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{http}/metrics", timeout=30).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _refusal(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value


# -- generated code -------------------------------------------------------------------------------------

def test_the_generated_modules_are_what_the_proto_generates(tmp_path):
    """serving/proto's _pb2 modules are committed: regenerated from the .proto (grpcio-tools as pinned in
    pyproject.toml's dev extra), they are the same files byte for byte."""
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) regenerates serving/proto")
    done = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", f"--python_out={tmp_path}",
                           f"--grpc_python_out={tmp_path}", PROTO], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for name in ("grpc_service_pb2.py", "grpc_service_pb2_grpc.py"):
        with open(os.path.join(ROOT, os.path.dirname(PROTO), name)) as f:
            committed = f.read()
        assert (tmp_path / os.path.dirname(PROTO) / name).read_text() == committed, \
            f"{name} differs from what {PROTO} generates: regenerate it (the command is in the .proto's header)"


# -- a repository of two models, with a token -------------------------------------------------------------

@pytest.mark.slow
def test_grpc_scores_equal_http_v2s_bitwise_raw_and_typed(repository):
    http_address, address, models = repository
    http, client = httpclient.InferenceServerClient(http_address), grpcclient.InferenceServerClient(address)
    channel = grpc.insecure_channel(address)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    metadata = list(_auth().items())
    for name, (served, rows) in models.items():
        for size in (1, len(next(iter(rows.values())))):
            arrays = _arrays(served, _rows(rows, size))
            want = http.infer(name, _inputs(httpclient, arrays), headers=_auth()).as_numpy("scores")
            assert want.shape == (size,)
            raw = client.infer(name, _inputs(grpcclient, arrays), headers=_auth(), request_id="r1")
            assert _same(raw.as_numpy("scores"), want), (name, size)
            answer = raw.get_response()
            assert (answer.model_name, answer.model_version, answer.id) == (name, "3", "r1")
            typed = stub.ModelInfer(_typed(name, arrays, model_version="3"), metadata=metadata)
            assert _same(_scores(typed), want), (name, size)
            asked = [grpcclient.InferRequestedOutput("scores")]
            assert _same(client.infer(name, _inputs(grpcclient, arrays), outputs=asked, headers=_auth(),
                                      compression_algorithm="gzip").as_numpy("scores"), want)
    client.close()
    channel.close()


@pytest.mark.slow
def test_grpc_health_metadata_config_and_index_are_http_v2s(repository):
    http_address, address, models = repository
    http, client = httpclient.InferenceServerClient(http_address), grpcclient.InferenceServerClient(address)
    assert client.is_server_live() and client.is_server_ready()  # open, as /v2/health/*
    assert client.get_server_metadata(as_json=True) == http.get_server_metadata()
    for name in models:
        assert client.is_model_ready(name) and client.is_model_ready(name, "3")  # open, as /v2/models/NAME/ready
        meta, want = client.get_model_metadata(name, headers=_auth()), http.get_model_metadata(name, headers=_auth())
        assert (meta.name, list(meta.versions), meta.platform) == (want["name"], want["versions"], want["platform"])
        assert [(t.name, t.datatype, list(t.shape)) for t in [*meta.inputs, *meta.outputs]] == \
            [(t["name"], t["datatype"], t["shape"]) for t in [*want["inputs"], *want["outputs"]]]
        config = client.get_model_config(name, headers=_auth()).config
        want = http.get_model_config(name, headers=_auth())
        assert (config.name, config.platform, config.backend, config.max_batch_size) == \
            (want["name"], want["platform"], want["backend"], want["max_batch_size"]) == (name, "deeprec", "deeprec", 0)
        got = [(t.name, model_config_pb2.DataType.Name(t.data_type), list(t.dims))
               for t in [*config.input, *config.output]]
        assert got == [(t["name"], t["data_type"], t["dims"]) for t in [*want["input"], *want["output"]]]
    index = client.get_model_repository_index(headers=_auth(), as_json=True)["models"]
    assert [(m["name"], m["version"], m["state"]) for m in index] == [("din", "3", "READY"), ("dlrm", "3", "READY")]
    assert len(client.get_model_repository_index(headers=_auth()).models) == 2
    client.close()


@pytest.mark.slow
def test_grpc_refusals_are_https_with_grpc_statuses_and_counted(repository):
    http_address, address, models = repository
    http, client = httpclient.InferenceServerClient(http_address), grpcclient.InferenceServerClient(address)
    served, rows = models["dlrm"]
    arrays = _arrays(served, _rows(rows, 2))
    counted = {code: _metric(http_address, "deeprec_requests_total", code=code, model=model)
               for code, model in (("200", "dlrm"), ("400", "dlrm"), ("401", ""), ("404", ""))}
    # the token, as HTTP's scoring and model routes require it
    for headers in (None, {"authorization": "Bearer wrong"}):
        for call in (lambda: client.infer("dlrm", _inputs(grpcclient, arrays), headers=headers),
                     lambda: client.get_model_metadata("dlrm", headers=headers),
                     lambda: client.get_model_config("dlrm", headers=headers),
                     lambda: client.get_model_repository_index(headers=headers)):
            refused = _refusal(call)
            assert refused.status() == "StatusCode.UNAUTHENTICATED" and "bearer token" in refused.message()
    # no such model, no such version
    refused = _refusal(lambda: client.infer("nope", _inputs(grpcclient, arrays), headers=_auth()))
    assert refused.status() == "StatusCode.NOT_FOUND"
    assert refused.message() == "no model 'nope' here (serving: din, dlrm)"
    refused = _refusal(lambda: client.infer("dlrm", _inputs(grpcclient, arrays), model_version="7", headers=_auth()))
    assert refused.status() == "StatusCode.NOT_FOUND" and "version '7' is not served: version 3 is" in refused.message()
    assert _refusal(lambda: client.is_model_ready("nope")).status() == "StatusCode.NOT_FOUND"
    # a bad request: INVALID_ARGUMENT with the message HTTP gives it, naming the input
    k = next(i for i, (n, _, _) in enumerate(arrays) if n == "C3")
    bytes_i1 = [("I1", "BYTES", np.array([b"1", b"2"], dtype=object)), *arrays[1:]]
    wide = [("I1", "FP32", np.zeros((2, 2), np.float32)), *arrays[1:]]
    unknown = [*arrays[:k], ("nope", "BYTES", arrays[k][2]), *arrays[k + 1:]]
    din, din_rows = models["din"]
    sequence = _arrays(din, {**din_rows, "hist_items": ["5|6", "7|x", ""]})
    cases = [("dlrm", bytes_i1, None, "$.inputs[0].datatype: input 'I1': datatype \"BYTES\", this input takes FP32"),
             ("dlrm", wide, None, "$.inputs[0].shape: input 'I1': shape [2, 2]"),
             ("dlrm", unknown, None, f"$.inputs[{k}].name: input 'nope' is not an input of the model"),
             ("dlrm", arrays, "prob", "$.outputs[0].name: output 'prob' is not an output of the model"),
             ("din", sequence, None, "$.inputs[3].data[1]: input 'hist_items': expected integer ids")]
    for name, inputs, output, words in cases:
        grpc_outputs = http_outputs = None
        if output is not None:
            grpc_outputs = [grpcclient.InferRequestedOutput(output)]
            http_outputs = [httpclient.InferRequestedOutput(output)]
        refused = _refusal(lambda: client.infer(name, _inputs(grpcclient, inputs), outputs=grpc_outputs,
                                                headers=_auth()))
        over_http = _refusal(lambda: http.infer(name, _inputs(httpclient, inputs), outputs=http_outputs,
                                                headers=_auth()))
        assert refused.status() == "StatusCode.INVALID_ARGUMENT", (words, refused)
        assert refused.message() == over_http.message() and refused.message().startswith(words), \
            (refused.message(), over_http.message())
    # counted in /metrics with HTTP's requests, by the HTTP status each stands for (the infers above only)
    client.infer("dlrm", _inputs(grpcclient, arrays), headers=_auth())
    assert _metric(http_address, "deeprec_requests_total", code="401", model="") == counted["401"] + 2
    assert _metric(http_address, "deeprec_requests_total", code="404", model="") == counted["404"] + 2
    assert _metric(http_address, "deeprec_requests_total", code="400", model="dlrm") == counted["400"] + 2 * 4
    assert _metric(http_address, "deeprec_requests_total", code="200", model="dlrm") == counted["200"] + 1
    client.close()


# -- one export: batches shared with HTTP, the size limit, raw and typed contents misused --------------------

@pytest.mark.slow
def test_grpc_and_http_requests_merge_into_one_batch(single):
    http_address, address, served, rows = single
    arrays, small = _arrays(served, rows), _arrays(served, _rows(rows, 3))
    want = httpclient.InferenceServerClient(http_address).infer("dlrm", _inputs(httpclient, arrays)).as_numpy("scores")
    alone = grpcclient.InferenceServerClient(address).infer("dlrm", _inputs(grpcclient, small)).as_numpy("scores")
    answered = _metric(http_address, "deeprec_requests_total", code="200")

    # connected once, before the rounds: only the two requests race to the batcher, not two connections
    # (tritonclient.http is gevent's: a client per pool thread, made in that thread)
    grpc_client, local = grpcclient.InferenceServerClient(address), threading.local()
    assert grpc_client.is_server_live()

    def over_grpc():
        return grpc_client.infer("dlrm", _inputs(grpcclient, small)).as_numpy("scores")

    def over_http():
        if not hasattr(local, "client"):
            local.client = httpclient.InferenceServerClient(http_address)
        return local.client.infer("dlrm", _inputs(httpclient, arrays)).as_numpy("scores")

    pool = concurrent.futures.ThreadPoolExecutor(2)
    for _ in range(2):  # connected before the rounds (a thread that takes its first HTTP call in a round connects then)
        pool.submit(over_http).result()
    for rounds in range(1, 11):  # the batcher waits 200 ms for company (--max-wait-ms): both arrive in it
        calls = _metric(http_address, "deeprec_batch_rows_count")
        scored = _metric(http_address, "deeprec_batch_rows_sum")
        a, b = pool.submit(over_grpc), pool.submit(over_http)
        a, b = a.result(), b.result()
        # a row's score in a batch of 11 rows, not of 3 or 8: equal up to the sums' order
        assert np.allclose(a, alone, rtol=1e-6, atol=0) and np.allclose(b, want, rtol=1e-6, atol=0)
        merged = (_metric(http_address, "deeprec_batch_rows_count") - calls,
                  _metric(http_address, "deeprec_batch_rows_sum") - scored)
        if merged == (1, 3 + len(want)):
            break
    else:
        pytest.fail(f"a gRPC and an HTTP request never shared a model call: {merged} (calls, rows)")
    pool.shutdown()
    # both protocols counted (the pool's first requests: HTTP only)
    assert _metric(http_address, "deeprec_requests_total", code="200") == answered + 2 + 2 * rounds


@pytest.mark.slow
def test_grpc_on_one_export_limits_and_misused_contents(single):
    http_address, address, served, rows = single
    client = grpcclient.InferenceServerClient(address)
    channel = grpc.insecure_channel(address)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    arrays = _arrays(served, _rows(rows, 4))
    want = httpclient.InferenceServerClient(http_address).infer("dlrm", _inputs(httpclient, arrays)).as_numpy("scores")
    assert _same(client.infer("dlrm", _inputs(grpcclient, arrays)).as_numpy("scores"), want)  # no token asked
    assert _same(_scores(stub.ModelInfer(_typed("dlrm", arrays))), want)
    index = client.get_model_repository_index(as_json=True)["models"]
    assert [(m["name"], m["state"]) for m in index] == [("dlrm", "READY")]
    # a message over --max-body-bytes: gRPC's own refusal, before it is read
    big = [("I1", "FP32", np.zeros(20_000, np.float32))]
    assert _refusal(lambda: client.infer("dlrm", _inputs(grpcclient, big))).status() == "StatusCode.RESOURCE_EXHAUSTED"
    refused = _refusal(lambda: client.infer("dlrm", _inputs(grpcclient, big), compression_algorithm="gzip"))
    assert refused.status() == "StatusCode.RESOURCE_EXHAUSTED"  # its 80 KB of zeros inflated, not the ~100 sent
    # typed contents misused; raw contents that do not match the inputs
    short = _typed("dlrm", arrays)
    del short.inputs[0].contents.fp32_contents[3:]
    cases = [(short, "$.inputs[0].contents.fp32_contents: input 'I1': 3 values, the shape [4] says 4"),
             (_typed("dlrm", arrays[:1]), None),  # the other columns left out: all missing, as over HTTP
             (service_pb2.ModelInferRequest(model_name="dlrm"), "$: the request has no inputs")]
    mixed = _typed("dlrm", arrays)
    mixed.inputs[0].contents.ClearField("fp32_contents")
    mixed.inputs[0].contents.int64_contents.extend([1, 2, 3, 4])
    cases.append((mixed, "$.inputs[0].contents.int64_contents: input 'I1': a FP32 input's values are in "
                         "contents.fp32_contents"))
    raw = service_pb2.ModelInferRequest(model_name="dlrm", inputs=[_typed("dlrm", arrays).inputs[0]])
    raw.inputs[0].ClearField("contents")
    raw.raw_input_contents.extend([arrays[0][2][:3].tobytes()])
    cases.append((raw, "$.raw_input_contents[0]: input 'I1': 12 bytes of binary data, 4 FP32 values are 16"))
    raw = service_pb2.ModelInferRequest(model_name="dlrm", inputs=[_typed("dlrm", arrays).inputs[0]])
    raw.raw_input_contents.extend([arrays[0][2].tobytes()])
    cases.append((raw, "$.inputs[0].contents: input 'I1': both contents and raw_input_contents"))
    raw = service_pb2.ModelInferRequest(model_name="dlrm", inputs=[_typed("dlrm", arrays).inputs[k] for k in (0, 1)])
    for tensor in raw.inputs:
        tensor.ClearField("contents")
    raw.raw_input_contents.extend([arrays[0][2].tobytes()])
    cases.append((raw, "$.raw_input_contents: 1 raw_input_contents for 2 inputs"))
    for request, words in cases:
        if words is None:
            assert _scores(stub.ModelInfer(request)).shape == (4,)
            continue
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(words), \
            err.value.details()
    client.close()
    channel.close()


@pytest.mark.slow
def test_a_grpc_port_in_use_stops_the_start_in_one_line(exports):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        done = subprocess.run([sys.executable, "-m", "deeprec", "serve", exports["dlrm"][0], "--port", "0",
                               "--grpc-port", str(taken.getsockname()[1])], capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert done.returncode == 2 and "cannot listen there" in done.stderr and "--grpc-port" in done.stderr, done
    assert "Traceback" not in done.stderr and "listening on" not in done.stdout


NOT_READY = """
import sys, torch, uvicorn
import deeprec as dr
from deeprec.serving.server import make_app
model = dr.serving.load(sys.argv[1])
weights = next(p for n, p in model.module.named_parameters() if p.dim() == 2)
with torch.no_grad():
    weights.fill_(float("nan"))  # its probe prediction fails: the model cannot answer
uvicorn.run(make_app(model, grpc_address=("127.0.0.1", 0)), host="127.0.0.1", port=0, log_level="warning",
            loop="uvloop")  # as deeprec serve runs: grpc.aio on uvloop's loop
"""


@pytest.mark.slow
def test_a_model_that_cannot_answer_is_unavailable_and_a_stopped_app_closes_grpc(exports):
    """make_app(grpc_address=...) under uvicorn on uvloop: the service starts and stops with the app."""
    path, rows = exports["dlrm"]
    proc = subprocess.Popen([sys.executable, "-c", NOT_READY, path], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("grpc listening on 127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
    address = line.split()[-1]
    client = grpcclient.InferenceServerClient(address)
    assert client.is_server_live() and not client.is_server_ready() and not client.is_model_ready("dlrm")
    inputs = _inputs(grpcclient, _arrays(dr.serving.load(path), _rows(rows, 2)))
    refused = _refusal(lambda: client.infer("dlrm", inputs))
    assert refused.status() == "StatusCode.UNAVAILABLE", refused
    assert refused.message().startswith("model 'dlrm' cannot answer: a probe prediction gave non-finite scores")
    client.close()
    _stopped(proc)
    host, port = address.rsplit(":", 1)
    with socket.socket() as probe:  # nothing listens there any more
        assert probe.connect_ex((host, int(port))) == errno.ECONNREFUSED
