"""deeprec serve under bad input and hostile conditions: a 4xx naming what is wrong, never a 500
for a client's request; a body limit, a bearer token, bad deltas refused, /healthz that tells."""
import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file
from starlette.testclient import TestClient

import deeprec as dr
from deeprec.atomic import sha256_file
from deeprec.serving.online import ExportFolder
from deeprec.serving.server import make_app

from test_serving import _din_export, _dlrm_export


@pytest.fixture(scope="module")
def dlrm(tmp_path_factory):
    return _dlrm_export(tmp_path_factory.mktemp("harden"))


@pytest.fixture(scope="module")
def din(tmp_path_factory):
    path = _din_export(tmp_path_factory.mktemp("din"))
    rows = {"user_id": [1, 2], "item_id": [3, 4], "category_id": [1, 2], "hist_items": [[5, 6, 7], "8|9"],
            "hist_cats": [[1, 2, 3], []]}
    return path, rows


def _rows(rows, n, start=0):
    return {k: v[start:start + n] for k, v in rows.items()}


def _client(path, **kw):
    return TestClient(make_app(dr.serving.load(path), **kw))


async def _gathered(tasks):
    return await asyncio.gather(*tasks, return_exceptions=True)


class _LoopClient:
    """The app's whole ASGI path (lifespan, routes, body limits) driven from an event loop in this
    thread (httpx's ASGITransport): TestClient hops between threads ~15 times a request, which made
    the fuzz below 3x slower (a 400: 2.1 against 0.5 ms)."""

    def __init__(self, path, **kw):
        self.app, self.loop = make_app(dr.serving.load(path), **kw), asyncio.new_event_loop()
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://testserver")

    def __enter__(self):
        self.lifespan = self.app.router.lifespan_context(self.app)
        self.loop.run_until_complete(self.lifespan.__aenter__())
        return self

    def post(self, url, **kw) -> httpx.Response:
        return self.loop.run_until_complete(self.client.post(url, **kw))

    def __exit__(self, *exc):
        try:
            self.loop.run_until_complete(self.client.aclose())
            self.loop.run_until_complete(self.lifespan.__aexit__(*exc))
        finally:  # as asyncio.run ends: what is left cancelled and awaited, then the loop closed
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(_gathered(pending))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()


def _bad(reply, path, *words):
    assert reply.status_code == 400, (reply.status_code, reply.text)
    body = reply.json()
    assert body["path"] == path and body["error"].startswith(f"{path}: "), body
    for word in words:
        assert word in body["error"], body


@pytest.mark.slow
def test_non_finite_and_out_of_range_dense_values_are_400_at_their_path(dlrm):
    path, rows = dlrm
    with _client(path) as client:
        for value, shown in ((float("inf"), "inf"), ("inf", '"inf"'), (1e39, "1e+39"), ("-1e39", '"-1e39"'),
                             ("Infinity", '"Infinity"')):
            body = json.dumps({"inputs": {**_rows(rows, 3), "I5": [1.0, value, None]}})  # inf: a JSON Infinity
            reply = client.post("/v1/predict", content=body)
            _bad(reply, "$.inputs.I5[1]", "expected a finite number", f"got {shown}")
        body = json.dumps({"inputs": {**_rows(rows, 2), "I2": [-float("inf"), 1]}})  # a JSON -Infinity literal
        _bad(client.post("/v1/predict", content=body), "$.inputs.I2[0]", "got -inf")
        nan = json.dumps({"inputs": {**_rows(rows, 2), "I2": [float("nan"), "nan"]}})  # NaN: missing, as before
        assert client.post("/v1/predict", content=nan).status_code == 200
        _bad(client.post("/v1/predict", json={"inputs": {**_rows(rows, 2), "C3": [[1], "x"]}}), "$.inputs.C3[0]",
             "got an array")
        _bad(client.post("/v1/predict", json={"inputs": {**_rows(rows, 2), "I1": [[[1.0]], 2]}}), "$.inputs.I1[0]")
        _bad(client.post("/v1/predict", json={"inputs": {**_rows(rows, 2), "I1": [True, {"a": 1}]}}),
             "$.inputs.I1[1]", "got an object")


def test_zero_rows_and_too_many_rows_are_400(dlrm):
    path, rows = dlrm
    with _client(path, max_rows=8) as client:
        _bad(client.post("/v1/predict", json={"inputs": _rows(rows, 0)}), "$.inputs", "0 rows")
        _bad(client.post("/v1/predict", json={"inputs": _rows(rows, 9)}), "$.inputs", "9 rows", "at most 8")
        assert client.post("/v1/predict", json={"inputs": _rows(rows, 8)}).status_code == 200
        _bad(client.post("/v1/predict", json={"inputs": {}}), "$.inputs")


def test_deep_nesting_is_400(dlrm):
    path, rows = dlrm
    with _client(path) as client:
        for depth in (100, 5000, 200_000):
            reply = client.post("/v1/predict", content=b'{"inputs": ' + b"[" * depth + b"]" * depth + b"}")
            assert reply.status_code == 400, (depth, reply.status_code)
        deep = {"inputs": {**_rows(rows, 1), "I3": [[[[[[1]]]]]]}}
        _bad(client.post("/v1/predict", json=deep), "$.inputs.I3[0]")


@pytest.mark.slow
def test_malformed_din_sequences_are_400_at_their_path(din):
    path, rows = din
    served = dr.serving.load(path)
    with _client(path) as client:
        good = client.post("/v1/predict", json={"inputs": rows})
        assert good.status_code == 200
        assert torch.equal(torch.tensor(good.json()["scores"], dtype=torch.float32), served(rows))
        cases = [([[5, "x"], []], "$.inputs.hist_items[0][1]", 'got "x"'),
                 ([[5, [6]], []], "$.inputs.hist_items[0][1]", "got an array"),
                 ([[5, {"id": 6}], []], "$.inputs.hist_items[0][1]", "got an object"),
                 ([[5, None], []], "$.inputs.hist_items[0][1]", "got null"),
                 ([[1], {"items": [5]}], "$.inputs.hist_items[1]", "got an object"),
                 ([[1], "5||x"], "$.inputs.hist_items[1]", "(id 2: '')"),
                 ([[1], 2.5], "$.inputs.hist_items[1]", "2.5"),
                 ([[1], [2 ** 70]], "$.inputs.hist_items[1][0]", "int64")]
        for value, where, words in cases:
            _bad(client.post("/v1/predict", json={"inputs": {**rows, "hist_items": value}}), where, words)
        _bad(client.post("/v1/predict", json={"inputs": {**rows, "item_id": ["a", 1]}}), "$.inputs.item_id[0]",
             "integer id")


def test_body_over_the_limit_is_413_without_reading_it_all(dlrm):
    path, rows = dlrm
    with _client(path, max_body_bytes=4096) as client:
        small = {"inputs": _rows(rows, 1)}
        assert client.post("/v1/predict", json=small).status_code == 200
        big = {"inputs": _rows(rows, 16)}
        assert len(json.dumps(big)) > 4096
        reply = client.post("/v1/predict", json=big)
        assert reply.status_code == 413 and "--max-body-bytes" in reply.json()["error"]
        sent = []

        def chunks():  # no Content-Length: read until the limit, then refused
            for _ in range(1000):
                sent.append(1)
                yield b" " * 1024

        reply = client.post("/v1/predict", content=chunks())
        assert reply.status_code == 413
        metrics = client.get("/metrics").text
        assert 'deeprec_requests_total{code="413"} 2.0' in metrics


def test_token_is_required_on_predict_only(dlrm):
    path, rows = dlrm
    with _client(path, token="s3cret") as client:
        body = {"inputs": _rows(rows, 2)}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Bearer s3cret "}):
            reply = client.post("/v1/predict", json=body, headers=headers)
            assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer", headers
        assert client.post("/v1/predict", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert client.get("/healthz").status_code == 200 and client.get("/metrics").status_code == 200
        assert 'deeprec_requests_total{code="401"} 4.0' in client.get("/metrics").text


def test_metrics_count_each_status_as_sent(dlrm):
    path, rows = dlrm
    model = dr.serving.load(path)
    with TestClient(make_app(model)) as client:
        assert client.post("/v1/predict", json={"inputs": _rows(rows, 2)}).status_code == 200
        assert client.post("/v1/predict", content=b"[").status_code == 400
        original = model.module, model.compiled  # the model breaks after its probe: scores NaN, never a 200
        model.module, model.compiled = lambda batch: {"logits": torch.full((batch_rows_of(batch),), float("nan"))}, None
        try:
            reply = client.post("/v1/predict", json={"inputs": _rows(rows, 3)})
        finally:
            model.module, model.compiled = original
        assert reply.status_code == 500 and "non-finite" in reply.json()["error"]
        metrics = client.get("/metrics").text
        for code in ("200", "400", "500"):
            assert f'deeprec_requests_total{{code="{code}"}} 1.0' in metrics, metrics


def batch_rows_of(batch):
    from deeprec.data.collate import batch_rows

    return batch_rows(batch)


def _export_dir(tmp_path, export):
    live = tmp_path / "live"
    live.mkdir()
    shutil.copytree(export, live / "full-000000003")
    return live


def _write_delta(live, step, after, tensors):
    base = str(live / f"delta-{step:09d}")
    save_file(tensors, base + ".safetensors")
    with open(base + ".json", "w") as f:  # a valid sha256: the values themselves are what is wrong
        json.dump({"format": 1, "step": step, "after": after, "variables": [],
                   "sha256": sha256_file(base + ".safetensors")}, f)


def _dense(model):
    return {k: v.detach().clone().contiguous() for k, v in model.module.state_dict().items()
            if v.is_floating_point() and "sorted_keys" not in k and k.endswith("weight")}


@pytest.mark.slow
def test_a_nan_delta_is_refused_and_the_server_keeps_its_version(dlrm, tmp_path, caplog):
    path, rows = dlrm
    live = _export_dir(tmp_path, path)
    folder = ExportFolder(str(live), lenient=True, check=lambda m: m.probe())
    model = folder.load()
    want = model(_rows(rows, 4))
    with TestClient(make_app(model, folder=folder, watch_interval_s=0.05)) as client:
        tensors = _dense(model)
        name = next(iter(tensors))
        tensors[name][0] = float("nan")
        _write_delta(live, 4, 3, tensors)
        deadline = time.monotonic() + 20
        while "refused_updates" not in client.get("/healthz").json() and time.monotonic() < deadline:
            time.sleep(0.05)
        health = client.get("/healthz")
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "ok" and body["step"] == 3 and body["refused_updates"] == 1
        assert body["last_refused"]["path"].endswith("delta-000000004.json")
        assert "non-finite" in body["last_refused"]["reason"]
        reply = client.post("/v1/predict", json={"inputs": _rows(rows, 4)})
        assert reply.status_code == 200 and reply.json()["step"] == 3
        assert torch.equal(torch.tensor(reply.json()["scores"], dtype=torch.float32), want)
        _write_delta(live, 5, 4, _dense(model))  # follows the refused one: refused too, named
        while client.get("/healthz").json()["refused_updates"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        looks = _checks(client)
        while _checks(client) < looks + 4 and time.monotonic() < deadline:  # never retried: counted once each
            time.sleep(0.05)
        metrics = client.get("/metrics").text
        assert "deeprec_model_updates_refused_total 2.0" in metrics and "deeprec_model_step 3.0" in metrics
        assert "deeprec_model_updates_total 0.0" in metrics
    assert any("online update refused" in r.getMessage() for r in caplog.records)
    with pytest.raises(dr.serving.ServingError, match="non-finite"):  # the Python API: strict
        dr.serving.load(str(live))


@pytest.mark.slow
def test_a_nan_full_export_is_refused_at_load(dlrm, tmp_path):
    path, _ = dlrm
    live = _export_dir(tmp_path, path)
    bad = live / "full-000000009"
    shutil.copytree(path, bad)
    tables = dict(__import__("safetensors.torch", fromlist=["load_file"]).load_file(str(bad / "tables.safetensors")))
    name = next(k for k, v in tables.items() if v.is_floating_point())
    tables[name] = tables[name].clone()
    tables[name].view(-1)[0] = float("inf")
    save_file(tables, str(bad / "tables.safetensors"))
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["sha256"]["tables.safetensors"] = sha256_file(str(bad / "tables.safetensors"))
    manifest["step"] = 9
    (bad / "manifest.json").write_text(json.dumps(manifest))
    folder = ExportFolder(str(live), lenient=True, check=lambda m: m.probe())
    assert folder.load().step == 3 and list(folder.refused) == [str(bad)]
    with pytest.raises(dr.serving.ServingError, match="non-finite"):
        dr.serving.load(str(live))


def test_healthz_is_503_when_the_model_cannot_answer(dlrm):
    path, rows = dlrm
    model = dr.serving.load(path)
    weights = next(p for n, p in model.module.named_parameters() if p.dim() == 2)
    with torch.no_grad():
        weights.fill_(float("nan"))
    with TestClient(make_app(model)) as client:
        reply = client.get("/healthz")
        assert reply.status_code == 503 and reply.json()["status"] == "not ready", reply.text
        assert "non-finite" in reply.json()["reason"]
        reply = client.post("/v1/predict", json={"inputs": _rows(rows, 2)})
        assert reply.status_code == 503
        assert "deeprec_model_ready 0.0" in client.get("/metrics").text


# -- a real server process -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_server(dlrm, tmp_path_factory):
    path, rows = dlrm
    token_file = tmp_path_factory.mktemp("tok") / "token"
    token_file.write_text("t0ken\n")
    env = {k: v for k, v in os.environ.items() if k != "DEEPREC_PS_TOKEN"}
    proc = subprocess.Popen([sys.executable, "-m", "deeprec", "serve", path, "--port", "0", "--max-rows", "64",
                             "--max-body-bytes", "64KiB", "--token-file", str(token_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    assert line.startswith("listening on http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
    yield line.split()[-1], rows, proc
    proc.terminate()
    proc.wait(20)


@pytest.mark.slow
def test_real_server_answers_each_case(real_server):
    url, rows, proc = real_server
    auth = {"Authorization": "Bearer t0ken"}
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.post("/v1/predict", json={"inputs": _rows(rows, 2)}).status_code == 401
        assert client.post("/v1/predict", json={"inputs": _rows(rows, 2)}, headers=auth).status_code == 200
        _bad(client.post("/v1/predict", json={"inputs": {**_rows(rows, 2), "I5": [1, "1e39"]}}, headers=auth),
             "$.inputs.I5[1]", "finite")
        _bad(client.post("/v1/predict", json={"inputs": _rows(rows, 0)}, headers=auth), "$.inputs", "0 rows")
        assert client.post("/v1/predict", content=b"[" * 60_000, headers=auth).status_code == 400
        big = {"inputs": {**_rows(rows, 1), "C1": ["x" * 70_000]}}
        assert client.post("/v1/predict", json=big, headers=auth).status_code == 413
        assert client.post("/v1/predict", content=(b" " * 4096 for _ in range(100)), headers=auth).status_code == 413
        assert client.get("/healthz").json()["status"] == "ok"
        metrics = client.get("/metrics").text
    assert 'deeprec_requests_total{code="413"} 2.0' in metrics and 'deeprec_requests_total{code="401"} 1.0' in metrics
    assert proc.poll() is None


# -- property-based fuzz -------------------------------------------------------------------------

FUZZ_REQUESTS = int(os.environ.get("DEEPREC_FUZZ_REQUESTS", "10000"))
PER_EXAMPLE = 5  # requests per hypothesis example: its per-example overhead shared


def _fuzz_strategies():
    from hypothesis import strategies as st

    scalar = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.integers(-5, 100),
                       st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False), st.sampled_from([1e39, -1e39, 3.4e38, 1e-45]),
                       st.text(max_size=6), st.sampled_from(["inf", "nan", "-Infinity", "1e39", "12", "0x10", "1|2",
                                                             "5||x", "", " 7 ", "\u00e9"]))
    value = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=3), inner, max_size=2)),
                         max_leaves=6)
    return st, scalar, value


def _fuzz_body(data, base, st, value):
    """A request: the valid base rows, then 0 to 3 mutations; sometimes raw bytes instead."""
    kind = data.draw(st.integers(0, 19))
    if kind == 0:
        return data.draw(st.binary(max_size=64))
    if kind == 1:
        depth = data.draw(st.integers(1, 3000))
        return b'{"inputs": {"I1": ' + b"[" * depth + b"]" * depth + b"}}"
    n = data.draw(st.integers(0, 6))
    inputs = {k: [v[i % len(v)] for i in range(n)] for k, v in base.items()}
    for _ in range(data.draw(st.integers(0, 3))):
        names = sorted(inputs) or ["I1"]
        name = data.draw(st.sampled_from(names + ["unknown", "hist_items"]))
        op = data.draw(st.integers(0, 6))
        if op == 0 and isinstance(inputs.get(name), list) and inputs[name]:
            inputs[name][data.draw(st.integers(0, len(inputs[name]) - 1))] = data.draw(value)
        elif op == 1:
            inputs.pop(name, None)
        elif op == 2:
            inputs[name] = data.draw(value)
        elif op == 3:
            inputs[name] = data.draw(st.lists(value, max_size=4))
        elif op == 4 and isinstance(inputs.get(name), list):
            inputs[name] = inputs[name][:-1]
        elif op == 5:  # a sequence value: ids, text, nested
            inputs[name] = [data.draw(st.one_of(st.lists(st.one_of(st.integers(-3, 2 ** 64), st.text(max_size=4),
                                                                    value), max_size=4), value)) for _ in range(n)]
        elif op == 6 and isinstance(inputs.get(name), list) and inputs[name]:
            inputs[name][0] = data.draw(st.sampled_from([float("inf"), 1e39, "inf", -float("inf"), float("nan")]))
    shape = data.draw(st.integers(0, 9))
    body = {"inputs": inputs} if shape else data.draw(st.sampled_from([{"rows": inputs}, [inputs], inputs, None]))
    return json.dumps(body, allow_nan=True).encode()


def _check(reply, request):
    assert reply.status_code in (200, 400, 413), (reply.status_code, reply.text, request[:300])
    body = reply.json()
    if reply.status_code == 200:
        scores = body["scores"]
        assert all(isinstance(s, float) and 0.0 <= s <= 1.0 for s in scores), body
    elif reply.status_code == 400:
        assert body["error"].startswith(body["path"] + ": ") and body["path"].startswith("$"), body


@pytest.mark.slow(reason="10,000 generated requests through the whole ASGI path (1-3 ms each on 2 cores)")
def test_fuzz_no_request_gets_a_500(dlrm, din, real_server):
    """>= 10,000 generated requests, valid and invalid, to the DLRM and DIN apps (in-process, through
    the whole ASGI path: _LoopClient) and a share to a real server process on loopback."""
    from hypothesis import HealthCheck, given, seed, settings

    st, _, value = _fuzz_strategies()
    # one fixed seed: the suite's result never depends on the draw; DEEPREC_FUZZ_SEED=random explores
    fuzz_seed = os.environ.get("DEEPREC_FUZZ_SEED", "20261128")
    fuzz_seed = random.randrange(2 ** 32) if fuzz_seed == "random" else int(fuzz_seed)
    print(f"fuzz seed {fuzz_seed} (rerun with DEEPREC_FUZZ_SEED={fuzz_seed})", flush=True)
    url, _, proc = real_server
    apps = {"dlrm": (_LoopClient(dlrm[0], max_rows=64, max_body_bytes=1 << 16), dlrm[1]),
            "din": (_LoopClient(din[0], max_rows=64, max_body_bytes=1 << 16), din[1])}
    real = httpx.Client(base_url=url, timeout=30, headers={"Authorization": "Bearer t0ken"})
    counts = {"requests": 0, "200": 0, "400": 0, "413": 0, "real": 0}
    for client, _ in apps.values():
        client.__enter__()
    started = time.monotonic()
    try:
        @seed(fuzz_seed)
        @settings(max_examples=-(-FUZZ_REQUESTS // PER_EXAMPLE), deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck))
        @given(st.data())
        def fuzz(data):
            for _ in range(PER_EXAMPLE):
                which = data.draw(st.sampled_from(["dlrm", "dlrm", "din"]))
                client, base = apps[which]
                request = _fuzz_body(data, base, st, value)
                to_real = which == "dlrm" and data.draw(st.integers(0, 24)) == 0
                reply = (real if to_real else client).post("/v1/predict", content=request)
                counts["requests"] += 1
                counts["real"] += to_real
                counts[str(reply.status_code)] = counts.get(str(reply.status_code), 0) + 1
                _check(reply, request)

        fuzz()
    finally:
        for client, _ in apps.values():
            client.__exit__(None, None, None)
        real.close()
        print(f"fuzz: {counts} in {time.monotonic() - started:.1f}s", flush=True)
    assert counts["requests"] >= FUZZ_REQUESTS and counts["200"] > 0 and counts["400"] > 0
    assert proc.poll() is None  # no crash
    metrics = httpx.get(f"{url}/metrics").text
    assert 'code="500"' not in metrics


def _checks(client) -> float:
    """How many times serving has looked at its export folder (its watcher's counter)."""
    text = client.get("/metrics").text
    return float(re.search(r"^deeprec_model_update_checks_total (\S+)$", text, re.M).group(1))
