"""deeprec serve's protocols: TF Serving's rows and routes, the Open Inference Protocol (KServe v2) spoken
by the official Triton client, a model repository, and greedy batching."""
import asyncio
import gzip
import json
import shutil
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

import deeprec as dr
from deeprec.serving import RequestError, ServingError
from deeprec.serving import batcher as batcher_module
from deeprec.serving.batcher import Batcher, Pending
from deeprec.serving.repository import open_repository
from deeprec.serving.request import request_rows
from deeprec.serving.server import make_app

from test_serving import _din_export, _dlrm_export, _trained


@pytest.fixture(scope="module")
def dlrm(tmp_path_factory):
    return _dlrm_export(tmp_path_factory.mktemp("proto-dlrm"), rows=16)


@pytest.fixture(scope="module")
def din(tmp_path_factory):
    """A DIN (int ids, sequences of int ids) trained 3 steps on synthetic behaviour data, and rows."""
    path = _din_export(tmp_path_factory.mktemp("proto-din"))
    rows = {"user_id": [1, 2, 7], "item_id": [3, 4, 5], "category_id": [1, 2, 3],
            "hist_items": [[5, 6, 7], [8, 9], [1]], "hist_cats": [[1, 2, 3], [4, 5], []]}
    return path, rows


@pytest.fixture(scope="module")
def mmoe(tmp_path_factory):
    """A multi-task MMoE (labels finish, like) and its rows."""
    tmp = tmp_path_factory.mktemp("proto-mmoe")
    trainer, data = _trained("mmoe", "table", tmp)
    path = dr.export(trainer.model, str(tmp / "mmoe"), schema=trainer.schema, model_name="mmoe", step=3,
                     compile=False)  # request handling; MMoE's package: test_serving_compiled
    rows = {c.name: [0.5, None, 3.0, 12.0, 0.0, 7.5] if c.kind == "dense" else [str(i * 13) for i in range(6)]
            for c in trainer.schema.columns if c.kind not in ("label", "ignore")}
    return path, rows


def _rows(rows, n, start=0):
    return {k: v[start:start + n] for k, v in rows.items()}


def _instances(rows):
    n = len(next(iter(rows.values())))
    return [{k: v[i] for k, v in rows.items()} for i in range(n)]


def _v2_inputs(served, rows):
    """JSON v2 inputs of `rows`, each with its metadata datatype (a sequence: ids joined, one BYTES per row)."""
    columns = {c.name: c for c in served.schema.columns}
    inputs = []
    for name, values in rows.items():
        c = columns[name]
        if c.kind == "sequence":
            values, kind = [v if isinstance(v, str) else c.separator.join(map(str, v)) for v in values], "BYTES"
        else:
            kind = "FP32" if c.kind == "dense" else "INT64" if c.dtype == "int" else "BYTES"
        inputs.append({"name": name, "datatype": kind, "shape": [len(values)], "data": values})
    return inputs


# -- in process (Starlette's TestClient: the whole ASGI path) ----------------------------------------

@pytest.mark.slow
def test_instances_score_as_columns_and_tf_serving_routes_answer_its_shapes(dlrm):
    path, rows = dlrm
    served = dr.serving.load(path)
    want = served(_rows(rows, 5)).numpy()
    with TestClient(make_app(served)) as client:
        columns = client.post("/v1/predict", json={"inputs": _rows(rows, 5)}).json()
        instances = _instances(_rows(rows, 5))
        del instances[2]["I3"], instances[4]["C9"]  # left out of a row: a missing value
        rows_body = client.post("/v1/predict", json={"instances": instances}).json()
        missing = _rows(rows, 5)
        missing["I3"][2], missing["C9"][4] = None, None
        assert np.array_equal(np.array(rows_body["predictions"], np.float32), served(missing).numpy())
        assert np.array_equal(np.array(columns["scores"], np.float32), want) and columns["step"] == 3
        tf = client.post("/v1/models/dlrm:predict", json={"instances": _instances(_rows(rows, 5))}).json()
        assert list(tf) == ["predictions"] and np.array_equal(np.array(tf["predictions"], np.float32), want)
        tf = client.post("/v1/models/dlrm/versions/3:predict", json={"inputs": _rows(rows, 5)}).json()
        assert list(tf) == ["outputs"] and np.array_equal(np.array(tf["outputs"], np.float32), want)
        status = client.get("/v1/models/dlrm").json()
        assert status == {"model_version_status": [{"version": "3", "state": "AVAILABLE",
                                                    "status": {"error_code": "OK", "error_message": ""}}]}
        signature = client.get("/v1/models/dlrm/metadata").json()["metadata"]["signature_def"]["signature_def"]
        assert signature["serving_default"]["inputs"]["C1"]["dtype"] == "DT_STRING"
        bad = client.post("/v1/predict", json={"instances": [instances[0], {**instances[1], "I5": "x"}]})
        assert bad.status_code == 400 and bad.json()["path"] == "$.instances[1].I5", bad.text
        bad = client.post("/v1/predict", json={"instances": [instances[0], {"nope": 1}]})
        assert bad.status_code == 400 and bad.json()["path"] == "$.instances[1].nope", bad.text
        bad = client.post("/v1/predict", json={"instances": [instances[0], [1, 2]]})
        assert bad.status_code == 400 and bad.json()["path"] == "$.instances[1]", bad.text
        assert client.post("/v1/models/other:predict", json={"inputs": _rows(rows, 2)}).status_code == 404
        assert client.post("/v1/models/dlrm/versions/7:predict", json={"inputs": _rows(rows, 2)}).status_code == 404


def test_v2_json_infer_and_errors_naming_the_input(dlrm):
    path, rows = dlrm
    served = dr.serving.load(path)
    want = served(_rows(rows, 4)).numpy()
    with TestClient(make_app(served)) as client:
        assert client.get("/v2/health/live").json() == {"live": True}
        assert client.get("/v2/health/ready").json() == {"ready": True}
        assert "binary_tensor_data" in client.get("/v2").json()["extensions"]
        meta = client.get("/v2/models/dlrm").json()
        kinds = {i["name"]: i["datatype"] for i in meta["inputs"]}
        assert kinds["I1"] == "FP32" and kinds["C1"] == "BYTES" and "label" not in kinds
        assert meta["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": [-1]}] and meta["versions"] == ["3"]
        inputs = _v2_inputs(served, _rows(rows, 4))
        reply = client.post("/v2/models/dlrm/infer", json={"id": "r1", "inputs": inputs})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["id"] == "r1" and body["model_name"] == "dlrm" and body["model_version"] == "3"
        assert np.array_equal(np.array(body["outputs"][0]["data"], np.float32), want)
        nested = [{**i, "shape": [4, 1], "data": [[v] for v in i["data"]]} for i in inputs]
        body = client.post("/v2/models/dlrm/versions/3/infer", content=gzip.compress(json.dumps(
            {"inputs": nested}).encode()), headers={"Content-Encoding": "gzip"}).json()
        assert np.array_equal(np.array(body["outputs"][0]["data"], np.float32), want)
        k = next(j for j, i in enumerate(inputs) if i["name"] == "I5")
        cases = [({"name": "I5", "datatype": "BYTES"}, f"$.inputs[{k}].datatype", "this input takes FP32"),
                 ({"name": "I5", "shape": [2, 2]}, f"$.inputs[{k}].shape", "expected [rows]"),
                 ({"name": "I5", "data": [1.0, "x", 2.0, 3.0]}, f"$.inputs[{k}].data[1]", "input 'I5'"),
                 ({"name": "I5", "data": [1.0]}, f"$.inputs[{k}].data", "1 values"),
                 ({"name": "nope"}, f"$.inputs[{k}].name", "not an input of the model")]
        for change, where, words in cases:
            bad = [{**i, **change} if j == k else i for j, i in enumerate(inputs)]
            reply = client.post("/v2/models/dlrm/infer", json={"inputs": bad})
            assert reply.status_code == 400 and reply.json()["error"].startswith(where + ": "), (where, reply.text)
            assert words in reply.json()["error"], reply.text
        reply = client.post("/v2/models/dlrm/infer", json={"inputs": inputs, "outputs": [{"name": "prob"}]})
        assert reply.status_code == 400 and reply.json()["error"].startswith("$.outputs[0].name: ")
        reply = client.post("/v2/models/nope/infer", json={"inputs": inputs})
        assert reply.status_code == 404 and "nope" in reply.json()["error"] and "dlrm" in reply.json()["error"]


@pytest.mark.slow
def test_multi_task_model_answers_one_output_per_label(mmoe):
    path, rows = mmoe
    served = dr.serving.load(path)
    want = served(_rows(rows, 3)).numpy()
    assert want.shape == (3, 2)
    with TestClient(make_app(served)) as client:
        meta = client.get("/v2/models/mmoe").json()
        assert [o["name"] for o in meta["outputs"]] == served.labels
        body = client.post("/v2/models/mmoe/infer", json={"inputs": _v2_inputs(served, _rows(rows, 3))}).json()
        for k, output in enumerate(body["outputs"]):
            assert output["name"] == served.labels[k]
            assert np.array_equal(np.array(output["data"], np.float32), want[:, k])
        rows_body = client.post("/v1/predict", json={"instances": _instances(_rows(rows, 3))}).json()
        assert [list(p) for p in rows_body["predictions"]] == [served.labels] * 3
        assert np.array_equal(np.array([[p[name] for name in served.labels] for p in rows_body["predictions"]],
                                       np.float32), want)
        columns = client.post("/v1/models/mmoe:predict", json={"inputs": _rows(rows, 3)}).json()["outputs"]
        assert np.array_equal(np.array(columns[served.labels[1]], np.float32), want[:, 1])


@pytest.mark.slow
def test_a_repository_serves_each_export_under_its_folder_name(dlrm, din, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(dlrm[0], repo / "ctr")
    shutil.copytree(din[0], repo / "din.v1")
    (repo / ".export-staging").mkdir()  # an export being written: skipped
    opened, is_repository = open_repository(str(repo))
    assert is_repository and sorted(opened) == ["ctr", "din.v1"]
    models = {name: model for name, (model, _) in opened.items()}
    with TestClient(make_app(models)) as client:
        reply = client.post("/v1/predict", json={"inputs": _rows(dlrm[1], 2)})
        assert reply.status_code == 400 and "ctr, din.v1" in reply.json()["error"]
        a = client.post("/v1/models/ctr:predict", json={"inputs": _rows(dlrm[1], 2)}).json()["outputs"]
        assert np.array_equal(np.array(a, np.float32), models["ctr"](_rows(dlrm[1], 2)).numpy())
        b = client.post("/v2/models/din.v1/infer", json={"inputs": _v2_inputs(models["din.v1"], din[1])}).json()
        assert np.array_equal(np.array(b["outputs"][0]["data"], np.float32), models["din.v1"](din[1]).numpy())
        health = client.get("/healthz").json()
        assert health["status"] == "ok" and health["models"]["din.v1"]["model"] == "din"
        index = client.post("/v2/repository/index").json()
        assert [(m["name"], m["state"]) for m in index] == [("ctr", "READY"), ("din.v1", "READY")]
        metrics = client.get("/metrics").text
        assert 'deeprec_requests_total{code="200",model="ctr"} 1.0' in metrics
        assert 'deeprec_requests_total{code="400",model=""} 1.0' in metrics
        assert 'deeprec_model_step{model="din.v1"} 3.0' in metrics
    (repo / "bad name").mkdir()
    with pytest.raises(ServingError, match="letters, digits"):
        open_repository(str(repo))
    shutil.rmtree(repo / "bad name")
    (repo / "empty").mkdir()
    with pytest.raises(ServingError, match="empty: neither an export"):
        open_repository(str(repo))


@pytest.mark.slow
def test_a_single_export_is_served_under_its_folder_name_or_model_name(dlrm, tmp_path):
    """A custom model's manifest names it module:attribute (a file path): no URL could address it."""
    copy = tmp_path / "my-ctr"
    shutil.copytree(dlrm[0], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["model"] = "/abs/path/dcn.py:DCNv2"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    rows = _rows(dlrm[1], 2)
    for name, want in ((None, "my-ctr"), ("ctr", "ctr")):
        opened, is_repository = open_repository(str(copy), name)
        assert not is_repository and list(opened) == [want]
        served = opened[want][0]
        with TestClient(make_app(served, name=name)) as client:
            scores = client.post(f"/v1/models/{want}:predict", json={"inputs": rows}).json()["outputs"]
            assert np.array_equal(np.array(scores, np.float32), served(rows).numpy())
            assert client.get(f"/v2/models/{want}").json()["name"] == want
            assert client.get(f"/v1/models/{want}").status_code == 200
            assert client.get("/v2/models/dlrm").status_code == 404
    with pytest.raises(ServingError, match="--model-name 'a b' cannot be a model's name in URLs"):
        open_repository(str(copy), "a b")
    spaced = tmp_path / "my ctr"
    copy.rename(spaced)
    with pytest.raises(ServingError, match="the folder's name 'my ctr' cannot be .*; give --model-name"):
        open_repository(str(spaced))
    assert list(open_repository(str(spaced), "ctr")[0]) == ["ctr"]
    with pytest.raises(ServingError, match="is a model repository, whose models are named by their folders"):
        open_repository(str(tmp_path), "ctr")


def test_token_guards_the_model_routes_not_health(dlrm):
    path, rows = dlrm
    with TestClient(make_app(dr.serving.load(path), token="s3cret")) as client:
        assert client.post("/v2/models/dlrm/infer", json={"inputs": []}).status_code == 401
        assert client.get("/v2/models/dlrm").status_code == 401
        assert client.post("/v1/models/dlrm:predict", json={"inputs": _rows(rows, 1)}).status_code == 401
        assert client.get("/v2/health/ready").status_code == 200 and client.get("/v2/models/dlrm/ready").status_code == 200
        assert client.get("/v2/models/dlrm", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_batcher_waits_on_no_clock():
    """A lone request is scored at once; those arriving while it scores form the next batch; one being
    read when a batch forms joins it."""
    class Model:
        def __init__(self):
            self.calls, self.release = [], threading.Event()

        def __call__(self, batch):
            self.calls.append(batch["x"].tolist())
            if len(self.calls) == 1:
                self.release.wait(10)
            return torch.sigmoid(batch["x"])

    class Rows:
        def observe(self, n):
            pass

    async def run():
        model = Model()
        batcher = Batcher(model, Rows(), max_batch=64, max_wait_s=0.0)
        batcher.INLINE_ROWS = 0  # every call in the scoring thread, which the first call holds
        batcher.start()
        first = asyncio.ensure_future(batcher.submit({"x": torch.tensor([1.0])}, 1))
        while not model.calls:
            await asyncio.sleep(0.001)
        later = [asyncio.ensure_future(batcher.submit({"x": torch.tensor([float(i)])}, 1)) for i in (2, 3, 4)]
        await asyncio.sleep(0.05)
        model.release.set()
        results = await asyncio.gather(first, *later)
        batcher.task.cancel()
        batcher.scorer.shutdown()
        return model.calls, [r[0].tolist() for r in results]

    calls, scores = asyncio.run(run())
    assert calls == [[1.0], [2.0, 3.0, 4.0]]
    assert scores == [[pytest.approx(float(torch.sigmoid(torch.tensor(x))))] for x in (1.0, 2.0, 3.0, 4.0)]

    async def reading():  # a request still being read when the batch forms joins it
        model = Model()
        model.release.set()
        batcher = Batcher(model, Rows(), max_batch=64, max_wait_s=0.0)
        batcher.start()

        async def late():
            with batcher.arriving():
                for _ in range(20):  # its body arriving, converted: 20 turns of the loop
                    await asyncio.sleep(0)
            return await batcher.submit({"x": torch.tensor([2.0])}, 1)

        second = asyncio.ensure_future(late())
        await asyncio.sleep(0)
        await asyncio.gather(batcher.submit({"x": torch.tensor([1.0])}, 1), second)
        batcher.task.cancel()
        batcher.scorer.shutdown()
        return model.calls

    assert asyncio.run(reading()) == [[1.0, 2.0]]


def test_a_batch_waits_for_as_many_requests_as_were_in_flight_together_before():
    """gRPC's calls reach the loop a few turns apart and are unseen until decoded (no `arriving()`): a
    batch waits, in turns of the loop up to MAX_TURNS, for as many requests as were in flight together
    since the previous batch formed; once the company is gone, one batch waits in vain, then a lone
    client is scored at once. Turns are counted by a ticker on the loop (no clock)."""
    calls = []

    class Rows:
        def observe(self, n):
            pass

    class Model:  # a compiled CPU package: a lone small request is scored on the loop (no thread hop)
        compiled, device = object(), torch.device("cpu")

        def __call__(self, batch):
            calls.append(batch["x"].tolist())
            return torch.sigmoid(batch["x"])

    async def run():
        batcher = Batcher(Model(), Rows(), max_batch=64, max_wait_s=0.0)
        batcher.start()

        async def after(turns: int, x: float):
            for _ in range(turns):
                await asyncio.sleep(0)
            return await batcher.submit({"x": torch.tensor([x])}, 1)

        async def turns_taken(request) -> int:
            task, ticks = asyncio.ensure_future(request), 0
            while not task.done():
                await asyncio.sleep(0)
                ticks += 1
            await task
            return ticks

        await asyncio.gather(after(0, 1.0), after(0, 2.0), after(0, 3.0))  # three clients together
        await asyncio.gather(after(0, 4.0), after(10, 5.0), after(20, 6.0))  # their next calls, turns apart
        waited = await turns_taken(after(0, 7.0))  # one client left: it waits for the other two, in vain
        alone = await turns_taken(after(0, 8.0))
        batcher.task.cancel()
        batcher.scorer.shutdown()
        return waited, alone, batcher.in_flight

    waited, alone, in_flight = asyncio.run(run())
    assert Batcher.TURNS < 20 < Batcher.MAX_TURNS
    assert calls == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0], [8.0]]
    assert waited >= Batcher.MAX_TURNS > 2 * Batcher.TURNS + 4 >= alone, (waited, alone)
    assert in_flight == 0


def test_a_lone_small_request_is_scored_on_the_event_loop_a_large_one_in_the_scoring_thread():
    """On the event loop only what is quick: a small lone request to a compiled CPU package."""
    threads = []

    class Model:
        device = torch.device("cpu")

        def __init__(self, compiled):
            self.compiled = compiled

        def __call__(self, batch):
            threads.append(threading.current_thread())
            return torch.sigmoid(batch["x"])

    class Rows:
        def observe(self, n):
            pass

    async def run(model, sizes):
        batcher = Batcher(model, Rows(), max_batch=64, max_wait_s=0.0)
        batcher.start()
        scores = [(await batcher.submit({"x": torch.ones(n)}, n))[0] for n in sizes]
        batcher.task.cancel()
        batcher.scorer.shutdown()
        return scores

    small, large = Batcher.INLINE_ROWS, Batcher.INLINE_ROWS + 1
    scores = asyncio.run(run(Model(compiled=object()), [small, large]))
    assert [s.shape for s in scores] == [(small,), (large,)]
    assert threads[0] is threading.main_thread()  # asyncio.run's loop runs here
    assert threads[1].name.startswith("deeprec-score")
    threads.clear()
    asyncio.run(run(Model(compiled=None), [small]))  # the traced program: never on the loop
    assert threads[0].name.startswith("deeprec-score")


def test_a_batch_converts_once_and_a_bad_value_fails_only_its_request(dlrm, monkeypatch):
    """The batcher merges the queued requests' columns and converts them in one call; a request with a
    bad value fails the merged conversion, then each request is scored alone: that one gets its 400
    (RequestError at its own path), the others their scores."""
    path, rows = dlrm
    served = dr.serving.load(path)
    calls = []

    class Rows:
        def observe(self, n):
            calls.append(n)

    def pending(columns):
        return Pending(columns, request_rows(served.schema, columns, "$.inputs"), "$.inputs")

    async def run(requests):  # queued before the batcher wakes: one batch
        batcher = Batcher(served, Rows(), max_batch=64, max_wait_s=0.0)
        batcher.start()
        futures = [asyncio.ensure_future(batcher.submit(r, r.rows)) for r in requests]
        results = await asyncio.gather(*futures, return_exceptions=True)
        batcher.task.cancel()
        batcher.scorer.shutdown()
        return results

    converted = []
    real = batcher_module.convert_columns
    monkeypatch.setattr(batcher_module, "convert_columns", lambda schema, columns, n, path="$":
                        converted.append(n) or real(schema, columns, n, path))
    parts = [_rows(rows, 3, 3 * i) for i in range(3)]
    results = asyncio.run(run([pending(part) for part in parts]))
    assert converted == [9] and calls == [9]  # one conversion, one model call for the three
    for part, (scores, model) in zip(parts, results):
        assert model is served and torch.allclose(torch.tensor(scores), served(part), atol=1e-6)
    converted.clear(), calls.clear()
    bad = {**_rows(rows, 2), "I1": [1.0, "x"]}
    results = asyncio.run(run([pending(parts[0]), pending(bad), pending(parts[1])]))
    assert isinstance(results[1], RequestError) and results[1].path == "$.inputs.I1[1]", results[1]
    assert "'x' is not a number" in str(results[1])
    for part, result in zip([parts[0], parts[1]], [results[0], results[2]]):
        assert torch.allclose(torch.tensor(result[0]), served(part), atol=1e-6)
    # the merged conversion failed, each was converted alone; the good two scored together
    assert converted == [8, 3, 2, 3] and calls == [6]


# -- a real server process and the official Triton client --------------------------------------------

@pytest.fixture(scope="module")
def repository_server(dlrm, din, tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(dlrm[0], repo / "dlrm")
    shutil.copytree(din[0], repo / "din")
    proc = subprocess.Popen([sys.executable, "-m", "deeprec", "serve", str(repo), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("listening on http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
    assert proc.stdout.readline().strip() == "models: din, dlrm"
    yield line.split()[-1], {"dlrm": (dr.serving.load(str(repo / "dlrm")), dlrm[1]),
                             "din": (dr.serving.load(str(repo / "din")), din[1])}
    proc.terminate()
    proc.wait(20)


def _triton_inputs(served, rows, binary: bool):
    """tritonclient InferInputs from the model's metadata datatypes: missing numbers NaN, ids as bytes."""
    import tritonclient.http as triton

    columns = {c.name: c for c in served.schema.columns}
    inputs = []
    for name, values in rows.items():
        c = columns[name]
        if c.kind == "dense":
            array, kind = np.array([np.nan if v is None else v for v in values], np.float32), "FP32"
        elif c.kind == "categorical" and c.dtype == "int":
            array, kind = np.array(values, np.int64), "INT64"
        else:
            text = [v if isinstance(v, str) else c.separator.join(map(str, v)) for v in values]
            array, kind = np.array([t.encode() for t in text], dtype=object), "BYTES"
        inputs.append(triton.InferInput(name, list(array.shape), kind).set_data_from_numpy(array, binary_data=binary))
    return inputs


@pytest.mark.slow
def test_tritonclient_gets_the_models_scores(repository_server):
    import tritonclient.http as triton
    from tritonclient.utils import InferenceServerException

    url, models = repository_server
    client = triton.InferenceServerClient(url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata()["name"] == "deeprec"
    for name, (served, rows) in models.items():
        assert client.is_model_ready(name)
        meta = client.get_model_metadata(name)
        assert meta["name"] == name and [i["name"] for i in meta["inputs"]] == \
            [c.name for c in served.schema.columns if c.kind not in ("label", "ignore")]
        assert client.get_model_config(name)["max_batch_size"] == 0
        n = len(next(iter(rows.values())))
        for size in (1, n):
            part = _rows(rows, size)
            want = served(part).numpy()
            for binary_in in (True, False):
                for outputs in (None, [triton.InferRequestedOutput("scores", binary_data=True)],
                                [triton.InferRequestedOutput("scores", binary_data=False)]):
                    result = client.infer(name, _triton_inputs(served, part, binary_in), outputs=outputs)
                    got = result.as_numpy("scores")
                    assert got.dtype == np.float32 and np.array_equal(got, want), (name, size, binary_in, outputs)
            result = client.infer(name, _triton_inputs(served, part, True), model_version="3",
                                  request_compression_algorithm="gzip")
            assert np.array_equal(result.as_numpy("scores"), want)
    served, rows = models["dlrm"]
    with pytest.raises(InferenceServerException, match="no model 'nope'") as err:
        client.infer("nope", _triton_inputs(served, _rows(rows, 2), True))
    assert err.value.status() == "404"
    bad = _triton_inputs(served, _rows(rows, 2), True)
    bad[0] = triton.InferInput(bad[0].name(), [2], "INT64").set_data_from_numpy(np.array([1, 2], np.int64))
    assert client.infer("dlrm", bad).as_numpy("scores").shape == (2,)  # ints are numbers: accepted
    bad[0] = triton.InferInput(bad[0].name(), [2], "BYTES").set_data_from_numpy(np.array([b"1", b"2"], dtype=object))
    with pytest.raises(InferenceServerException, match=r"\$\.inputs\[0\]\.datatype: input 'I1': datatype \"BYTES\""):
        client.infer("dlrm", bad)
    bad[0] = triton.InferInput("I1", [1, 2], "FP32").set_data_from_numpy(np.zeros((1, 2), np.float32))
    with pytest.raises(InferenceServerException, match=r"\$\.inputs\[0\]\.shape: input 'I1': shape \[1, 2\]"):
        client.infer("dlrm", bad)
    client.close()


@pytest.mark.slow
def test_v1_routes_of_a_repository_server(repository_server):
    url, models = repository_server
    served, rows = models["dlrm"]
    reply = httpx.post(f"{url}/v1/predict", json={"inputs": _rows(rows, 2)}, timeout=30)
    assert reply.status_code == 400 and "din, dlrm" in reply.json()["error"]
    reply = httpx.post(f"{url}/v1/models/dlrm:predict", json={"instances": _instances(_rows(rows, 3))}, timeout=30)
    assert np.array_equal(np.array(reply.json()["predictions"], np.float32), served(_rows(rows, 3)).numpy())


def _binary_body(inputs, outputs=None, parameters=None):
    """A v2 body of binary tensors, built by hand: [(name, datatype, shape, raw bytes)]."""
    header = {"inputs": [{"name": n, "datatype": t, "shape": s, "parameters": {"binary_data_size": len(raw)}}
                         for n, t, s, raw in inputs]}
    if outputs is not None:
        header["outputs"] = outputs
    if parameters is not None:
        header["parameters"] = parameters
    text = json.dumps(header).encode()
    return text + b"".join(raw for *_, raw in inputs), {"Inference-Header-Content-Length": str(len(text))}


def _bytes_tensor(values):
    return b"".join(len(v).to_bytes(4, "little") + v for v in values)


def test_v2_binary_tensors_by_hand(din):
    path, rows = din
    served = dr.serving.load(path)
    want = served(rows).numpy()
    columns = {c.name: c for c in served.schema.columns}
    inputs = []
    for name, values in rows.items():
        if columns[name].kind == "sequence":
            inputs.append((name, "BYTES", [3, 1], _bytes_tensor(["|".join(map(str, v)).encode() for v in values])))
        else:
            kind = "INT32" if name == "user_id" else "INT64"  # another integer width: taken
            inputs.append((name, kind, [3], np.array(values, "<i4" if kind == "INT32" else "<i8").tobytes()))
    with TestClient(make_app(served)) as client:
        body, headers = _binary_body(inputs, parameters={"binary_data_output": True})
        reply = client.post("/v2/models/din/infer", content=body, headers=headers)
        assert reply.status_code == 200, reply.text
        size = int(reply.headers["inference-header-content-length"])
        header = json.loads(reply.content[:size])
        assert header["outputs"][0]["parameters"] == {"binary_data_size": 12}
        assert np.array_equal(np.frombuffer(reply.content[size:], "<f4"), want)
        body, headers = _binary_body(inputs, outputs=[{"name": "scores", "parameters": {"binary_data": False}}],
                                     parameters={"binary_data_output": True})
        reply = client.post("/v2/models/din/infer", content=body, headers=headers)
        assert "inference-header-content-length" not in reply.headers
        assert np.array_equal(np.array(reply.json()["outputs"][0]["data"], np.float32), want)
        k = next(j for j, i in enumerate(inputs) if i[0] == "hist_items")
        cases = [(lambda i: (i[0], i[1], i[2], i[3][:-1]) if i[0] == "hist_items" else i,
                  f"$.inputs[{k}].data[2]", "the binary data ends in BYTES element 2"),
                 (lambda i: (i[0], i[1], i[2], i[3] + b"x") if i[0] == "hist_items" else i,
                  f"$.inputs[{k}].parameters.binary_data_size", "1 bytes after its 3 BYTES elements"),
                 (lambda i: (i[0], i[1], i[2], _bytes_tensor([b"5|x", b"1", b"2"])) if i[0] == "hist_items" else i,
                  f"$.inputs[{k}].data[0]", "input 'hist_items'"),
                 (lambda i: (i[0], i[1], i[2], _bytes_tensor([b"\xff", b"1", b"2"])) if i[0] == "hist_items" else i,
                  f"$.inputs[{k}].data[0]", "not UTF-8"),
                 (lambda i: (i[0], i[1], i[2], i[3][:8]) if i[0] == "item_id" else i,
                  "$.inputs[1].parameters.binary_data_size", "8 bytes of binary data, 3 INT64 values are 24")]
        for change, where, words in cases:
            body, headers = _binary_body([change(i) for i in inputs])
            reply = client.post("/v2/models/din/infer", content=body, headers=headers)
            assert reply.status_code == 400 and reply.json()["error"].startswith(where + ": "), (where, reply.text)
            assert words in reply.json()["error"], reply.text
        body, headers = _binary_body(inputs)
        for bad in ("x", str(len(body) + 1)):
            reply = client.post("/v2/models/din/infer", content=body, headers={"Inference-Header-Content-Length": bad})
            assert reply.status_code == 400 and "Inference-Header-Content-Length" in reply.json()["error"]
        reply = client.post("/v2/models/din/infer", content=body + b"\0\0", headers=headers)
        assert reply.status_code == 400 and "2 bytes of binary data after the inputs" in reply.json()["error"]


def test_row_limits_hold_before_a_body_is_spread_into_columns(dlrm):
    path, rows = dlrm
    served = dr.serving.load(path)
    with TestClient(make_app(served, max_rows=4)) as client:
        # a small body claiming many rows is refused before any column is built for them
        reply = client.post("/v1/predict", json={"instances": [{}] * 5})
        assert reply.status_code == 400 and reply.json()["path"] == "$.instances" and "--max-rows" in reply.json()["error"]
        inputs = [{"name": "I1", "datatype": "FP32", "shape": [10 ** 9], "data": []}]
        reply = client.post("/v2/models/dlrm/infer", json={"inputs": inputs})
        assert reply.status_code == 400 and "$.inputs[0].shape" in reply.json()["error"]
        # a header length in non-ASCII digits is a 400 naming the header, not a server error
        reply = client.post("/v2/models/dlrm/infer", content=b"{}", headers={"Inference-Header-Content-Length": b"\xb2"})  # latin-1 "²"
        assert reply.status_code == 400 and "Inference-Header-Content-Length" in reply.json()["error"]


def test_a_shape_is_rows_or_rows_by_one_in_plain_ints():
    from deeprec.serving.protocols import _shape

    assert _shape([3], "I1", 0) == 3 and _shape([3, 1], "I1", 0) == 3 and _shape([0], "I1", 0) == 0
    for shape in ([2, True], [2, 1.0], [True], [2.0], [-1], [2, 2], [2, 1, 1], [], "2", None):
        with pytest.raises(RequestError, match=r"expected \[rows\] or \[rows, 1\]"):
            _shape(shape, "I1", 4)
