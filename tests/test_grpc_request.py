"""gRPC's lean reading of a plain ModelInferRequest (grpc_service._plain_raw: every input raw, of its declared
datatype, shape [rows] or [rows, 1]) gives exactly what the general reading gives, and declines anything
else, which the general reading then takes or refuses with its message.

The checks run in a child process: deeprec's gRPC messages and tritonclient.grpc's (imported by other test
modules, maybe in this worker) define the same protobuf package, and one process cannot load both."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECKS = r'''
import json
import numpy as np
from types import SimpleNamespace
from deeprec.data.schema import Column, Schema
from deeprec.serving import RequestError
from deeprec.serving import grpc_service as gs
from deeprec.serving.proto import grpc_service_pb2 as pb

schema = Schema([Column("click", "label"), Column("price", "dense"), Column("uid", "categorical"),
                 Column("shop", "categorical", dtype="int"), Column("history", "sequence")])
model = SimpleNamespace(schema=schema, labels=["click"])
ELEMENTS = lambda values: b"".join(len(v).to_bytes(4, "little") + v for v in values)


def request(rows, *, shape=None, kinds=None, drop=(), twice=False, trailing=b"", params=False,
            outputs=()):
    kinds = {"price": "FP32", "uid": "BYTES", "shop": "INT64", "history": "BYTES", **(kinds or {})}
    numpy = {"FP32": "<f4", "FP64": "<f8", "INT64": "<i8", "INT32": "<i4"}
    blobs = {"price": np.arange(rows, dtype=numpy[kinds["price"]]).tobytes(),
             "shop": np.arange(rows, dtype=numpy[kinds["shop"]]).tobytes(),
             "uid": ELEMENTS([f"u{i}".encode() for i in range(rows)]) + trailing,
             "history": ELEMENTS([b"1|2|3"] * rows)}
    r = pb.ModelInferRequest(model_name="m", id="7")
    names = [n for n in ("price", "uid", "shop", "history") if n not in drop] + (["price"] if twice else [])
    for name in names:
        t = r.inputs.add(name=name, datatype=kinds[name], shape=shape or [rows])
        if params:
            t.parameters["x"].int64_param = 1
        r.raw_input_contents.append(blobs[name])
    for name in outputs:
        r.outputs.add(name=name)
    return r


def general(r, max_rows=None):
    saved, gs._plain_raw = gs._plain_raw, lambda *a: None
    try:
        return gs.v2_request(r, model, max_rows)
    finally:
        gs._plain_raw = saved


def same(a, b):
    assert (a.id, a.order, a.outputs) == (b.id, b.order, b.outputs), (a.order, b.order)
    assert list(a.columns) == list(b.columns)
    for name in a.columns:
        x, y = a.columns[name], b.columns[name]
        assert type(x) is type(y), (name, type(x), type(y))
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name
        else:
            assert x == y, name


taken = 0
for r in (request(1), request(3), request(2, shape=[2, 1]), request(1, drop=("history",)),
          request(4, outputs=("scores",))):
    fast = gs._plain_raw(r, model, None)
    assert fast is not None
    same(fast, general(r))
    taken += 1

def with_contents(r):
    r.inputs[0].contents.fp32_contents.append(1.0)
    return r


declined = 0
for r, max_rows, refusal in (  # declined by the lean reading; the general one accepts (None) or refuses
        (request(2, kinds={"shop": "INT32"}), None, None), (request(1, kinds={"price": "FP64"}), None, None),
        (request(2, params=True), None, None), (request(1, twice=True), None, "given twice"),
        (request(2, trailing=b"x"), None, "1 bytes after"), (request(1, trailing=b"xy"), None, "2 bytes after"),
        (request(5), 4, "at most 4"), (request(2, shape=[2, 2]), None, "shape [2, 2]"),
        (request(1, shape=[-1]), None, "shape [-1]"), (with_contents(request(1)), None, "both contents")):
    assert gs._plain_raw(r, model, max_rows) is None
    try:
        general(r, max_rows)
        assert refusal is None, f"accepted, expected a refusal: {refusal}"
    except RequestError as err:
        assert refusal is not None and refusal in str(err), (refusal, str(err))
    declined += 1
mixed = request(2)
mixed.inputs[1].shape[0] = 3
assert gs._plain_raw(mixed, model, None) is None
try:
    general(mixed)
    raise AssertionError("rows of two counts were taken")
except RequestError as err:
    assert "3 rows" in str(err), str(err)
print(json.dumps({"taken": taken, "declined": declined}))
'''


def test_plain_grpc_requests_read_leanly_as_the_general_reading_does():
    out = subprocess.run([sys.executable, "-c", CHECKS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"taken": 5, "declined": 10}
