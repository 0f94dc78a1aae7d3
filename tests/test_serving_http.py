"""deeprec serve: a real server process on loopback, a real HTTP client."""
import concurrent.futures
import subprocess
import sys

import httpx
import pytest
import torch

import deeprec as dr
from deeprec.cli import sample_path
from deeprec.trainer import Trainer

from test_serving import _dlrm_export, _json_rows


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path, rows = _dlrm_export(tmp_path_factory.mktemp("serve"), rows=64)
    proc = subprocess.Popen([sys.executable, "-m", "deeprec", "serve", path, "--port", "0", "--max-wait-ms", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("listening on http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
    url = line.split()[-1]
    yield url, dr.serving.load(path), rows
    proc.terminate()
    proc.wait(20)


def _rows(rows, start, n):
    return {k: v[start:start + n] for k, v in rows.items()}


@pytest.mark.slow
def test_predict_returns_the_models_scores(server):
    url, served, rows = server
    for n in (1, 5, 64):
        reply = httpx.post(f"{url}/v1/predict", json={"inputs": _rows(rows, 0, n)}, timeout=30)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["step"] == 3 and len(body["scores"]) == n
        want = served(_rows(rows, 0, n))
        assert torch.equal(torch.tensor(body["scores"], dtype=torch.float32), want)  # exact through JSON


def test_concurrent_requests_are_batched_and_each_gets_its_rows(server):
    url, served, rows = server

    def ask(i):
        return i, httpx.post(f"{url}/v1/predict", json={"inputs": _rows(rows, i, 3)}, timeout=60).json()["scores"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, range(40)))
    for i, scores in replies:  # batched with others, scored alike up to float rounding of the batch's gemm
        assert torch.allclose(torch.tensor(scores), served(_rows(rows, i, 3)), atol=1e-6), i
    metrics = httpx.get(f"{url}/metrics").text
    count = float(next(l.split()[-1] for l in metrics.splitlines() if l.startswith("deeprec_batch_rows_count")))
    total = float(next(l.split()[-1] for l in metrics.splitlines() if l.startswith("deeprec_batch_rows_sum")))
    assert total / count > 3  # requests of 3 rows were merged


def test_bad_requests_get_400_naming_the_field(server):
    url, _, rows = server
    absent = httpx.post(f"{url}/v1/predict", json={"inputs": {k: v for k, v in _rows(rows, 0, 2).items()
                                                             if k != "C7"}}, timeout=30)
    empty = httpx.post(f"{url}/v1/predict", json={"inputs": {**_rows(rows, 0, 2), "C7": ["", ""]}}, timeout=30)
    assert absent.status_code == 200 and absent.json() == empty.json()  # an absent column is missing, as ""
    cases = [({"inputs": {**_rows(rows, 0, 2), "I4": ["a", "b"]}}, "field 'I4'"),
             ({"rows": {}}, "the body must be"),
             ({"inputs": {**_rows(rows, 0, 2), "I1": 3}}, "field 'I1': must be a list")]
    for body, message in cases:
        reply = httpx.post(f"{url}/v1/predict", json=body, timeout=30)
        assert reply.status_code == 400 and message in reply.json()["error"], (reply.status_code, reply.text)
    reply = httpx.post(f"{url}/v1/predict", content=b"{not json", timeout=30)
    assert reply.status_code == 400 and "not JSON" in reply.json()["error"]


def test_health_and_metrics(server):
    url, _, rows = server
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok", "step": 3, "model": "dlrm"}
    httpx.post(f"{url}/v1/predict", json={"inputs": _rows(rows, 0, 2)}, timeout=30)
    metrics = httpx.get(f"{url}/metrics").text
    assert 'deeprec_requests_total{code="200"}' in metrics and "deeprec_model_step 3.0" in metrics
    assert "deeprec_request_latency_seconds_bucket" in metrics


@pytest.mark.slow
def test_serve_follows_new_deltas_without_a_restart(tmp_path):
    import shutil
    import time

    from test_serving import _online_cfg

    exports, live = tmp_path / "exports", tmp_path / "live"
    trainer = Trainer(_online_cfg(tmp_path, 11, export_dir=str(exports), export_every=5, export_incremental_every=2))
    trainer.train()
    live.mkdir()
    shutil.copytree(exports / "full-000000010", live / "full-000000010")  # the server starts on step 10
    proc = subprocess.Popen([sys.executable, "-m", "deeprec", "serve", str(live), "--port", "0",
                             "--watch-interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().split()[-1]
        assert httpx.get(f"{url}/healthz").json()["step"] == 10
        for suffix in (".safetensors", ".json"):  # the .json last, as the trainer writes it
            shutil.copy(exports / f"delta-000000011{suffix}", live / f"delta-000000011{suffix}")
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/healthz").json()["step"] != 11 and time.monotonic() < deadline:
            time.sleep(0.1)
        rows = _json_rows(sample_path("criteo_sample.txt"), trainer.schema, 8)
        reply = httpx.post(f"{url}/v1/predict", json={"inputs": rows}, timeout=30).json()
        assert reply["step"] == 11
        trainer.model.eval()
        with torch.no_grad():
            want = torch.sigmoid(trainer.model(dr.serving.load(str(exports)).batch(rows))["logits"])
        assert torch.equal(torch.tensor(reply["scores"], dtype=torch.float32), want)
        assert "deeprec_model_updates_total 1.0" in httpx.get(f"{url}/metrics").text
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.slow
def test_an_over_limit_body_is_a_413_that_every_client_reads(server):
    """The server drains the rest of the body before it answers: answering and closing while the client
    still sends resets the connection, and urllib (which writes the whole body first) saw the reset.
    So does a 404 sent before the body is read."""
    import json
    import re
    import urllib.error
    import urllib.request

    import requests

    _, served, _ = server
    proc = subprocess.Popen([sys.executable, "-m", "deeprec", "serve", served.path, "--port", "0",
                             "--max-body-bytes", "200000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        assert proc.stdout.readline() == "model: dlrm\n"  # the export's folder name (_dlrm_export's)
        url = line.split()[-1] + "/v1/predict"
        body = json.dumps({"inputs": {"C1": ["68fd1e64" * 100] * 4000}}).encode()  # 3.2 MB
        assert len(body) > 3_000_000
        for _ in range(20):
            request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=60)
            assert refused.value.code == 413 and "--max-body-bytes" in refused.value.read().decode()
        assert requests.post(url, data=body, timeout=60).status_code == 413
        assert httpx.post(url, content=body, timeout=60).status_code == 413
        chunked = httpx.post(url, content=iter([body[i:i + 65536] for i in range(0, len(body), 65536)]), timeout=60)
        small = json.dumps({"inputs": {"C1": ["68fd1e64" * 100] * 180}}).encode()  # under the limit, never read
        assert 100_000 < len(small) < 200_000
        other = urllib.request.Request(url.replace("/v1/predict", "/v1/models/nope:predict"), data=small)
        for _ in range(10):
            with pytest.raises(urllib.error.HTTPError) as missing:
                urllib.request.urlopen(other, timeout=60)
            assert missing.value.code == 404 and "no model 'nope'" in missing.value.read().decode()
        # no length: read to past the limit ("N+ bytes"), the rest drained
        assert chunked.status_code == 413 and re.search(r": \d+\+ bytes", chunked.json()["error"])
    finally:
        proc.terminate()
        proc.wait(20)
