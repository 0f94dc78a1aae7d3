"""The bodies `deeprec serve` reads and writes: its own columns, TF Serving's REST API, and the Open
Inference Protocol (KServe v2, as Triton speaks it) with Triton's binary tensor extension.

    {"inputs": {"C": [value per row]}}             columns (ours; TF Serving's "columnar" format)
    {"instances": [{"C": value}, ...]}              rows (TF Serving's "row" format)
    {"inputs": [{"name", "datatype", "shape", "data"}]}   v2, `data` JSON or binary after the JSON header

Every format becomes the same columns {name: values per row} for ServedModel.batch. An error it names
at a column's path ($.inputs.C[i]) is named again at the path the client sent ($.instances[i].C,
$.inputs[k].data[i]). Bodies are decoded and answers encoded with orjson: no Python per value.
"""
from __future__ import annotations

import json
import re

import numpy as np
import orjson

from deeprec import _C
from deeprec.serving import RequestError
from deeprec.serving.request import key

NESTING = ("the body nests deeper than any request may (a request is {\"inputs\": {\"column\": [value per "
           "row]}}, a sequence value one list deeper)")
# orjson reads an integer beyond 64 bits as a float: such a body goes to json, which keeps it exact. Found
# in C speed: digits -> "0", JSON's separators -> " ", "-" kept, the rest (quotes, ".", letters) -> "x";
# then a number token of 20+ digits (beyond uint64) or "-" and 19 digits (maybe beyond int64).
_TOKENS = bytes(48 if 48 <= c <= 57 else 45 if c == 45 else 32 if bytes([c]) in b"[]{},: \t\r\n" else 120
                for c in range(256))
_BIG = (b" " + b"0" * 20, b"-" + b"0" * 19)


def _big_integer(body: bytes) -> bool:
    tokens = body.translate(_TOKENS)
    return _BIG[0] in tokens or _BIG[1] in tokens


def loads(body: bytes):
    """The JSON value of `body`; a RequestError saying why not. NaN and Infinity literals (orjson refuses
    them) and integers beyond 64 bits go through Python's json: NaN is a missing value, and an infinity
    or a too-large id is named at its path by the checks after."""
    first = None
    if not _big_integer(body):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as err:
            if "depth limit" in str(err):
                raise RequestError(NESTING) from None
            first = err
    try:
        return json.loads(body)
    except RecursionError:
        raise RequestError(NESTING) from None
    except ValueError as err:  # UnicodeDecodeError included
        raise RequestError(f"the body is not JSON ({first or err})") from None


def dumps(value) -> bytes:
    """JSON bytes; numpy arrays (C-contiguous) written natively, float32 at its shortest exact form."""
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)


def model_inputs(model) -> list:
    """The schema columns a request gives (labels and ignored columns left out)."""
    return list(model.schema.derived("v2_inputs", _inputs_of)[0].values())


def output_names(model) -> list[str]:
    """One output "scores", or one per label of a multi-task model (named after the label)."""
    return ["scores"] if len(model.labels) == 1 else list(model.labels)


def output_values(scores: np.ndarray, model, name: str) -> np.ndarray:
    if scores.ndim == 1:
        return scores
    return np.ascontiguousarray(scores[:, model.labels.index(name)])


# -- path mapping ---------------------------------------------------------------------------------

_HEAD = re.compile(r'\.([A-Za-z_][A-Za-z0-9_]*)|\[("(?:[^"\\]|\\.)*")\]')
_INDEX = re.compile(r"\[(\d+)\]")


def _renamed(err: RequestError, base: str, where) -> RequestError:
    """`err` with its path `base` + column + tail rewritten as where(column, key text, row, rest)
    (row None: the error is about the whole column); unchanged if its path is not one of a column."""
    if not err.path.startswith(base):
        return err
    head = _HEAD.match(err.path, len(base))
    if head is None:
        return err
    name = head.group(1) or json.loads(head.group(2))
    tail = err.path[head.end():]
    index = _INDEX.match(tail)
    row, rest = (int(index.group(1)), tail[index.end():]) if index else (None, tail)
    path, reason = where(name, head.group(0), row, rest)
    return err if path is None else RequestError(reason or err.reason, path)


# -- v1: columns and TF Serving's instances ---------------------------------------------------------

def _check_rows(rows: int, max_rows: int | None, path: str) -> None:
    if max_rows is not None and rows > max_rows:
        raise RequestError(f"{rows} rows, this server takes at most {max_rows} per request (--max-rows): "
                           f"split the request", path)


def v1_columns(body, model, max_rows: int | None = None) -> tuple[dict, str]:
    """(columns, style): style "inputs" for {"inputs": {column: [values]}}, "instances" for rows."""
    if isinstance(body, dict) and "inputs" in body and "instances" not in body and isinstance(body["inputs"], dict):
        return body["inputs"], "inputs"
    if isinstance(body, dict) and "instances" in body and "inputs" not in body:
        if not isinstance(body["instances"], list):
            raise RequestError("\"instances\" must be a list of rows: [{\"column\": value, ...}, ...]", "$.instances")
        _check_rows(len(body["instances"]), max_rows, "$.instances")  # before the rows are spread into columns
        return _transposed(body["instances"], model), "instances"
    raise RequestError("the body must be {\"inputs\": {\"column\": [value per row], ...}} (columns) or "
                       "{\"instances\": [{\"column\": value, ...}, ...]} (rows, as TF Serving takes them)")


def _transposed(instances: list, model) -> dict:
    """Rows to columns in one pass; a column a row leaves out is a missing value of that row (and one
    no row gives is absent: all missing, as an absent column of a columns request)."""
    n, columns = len(instances), {}
    known = {c.name for c in model.schema.columns}
    for i, row in enumerate(instances):
        if not isinstance(row, dict):
            raise RequestError(f"row {i}: expected an object {{\"column\": value, ...}}, got "
                               f"{'an array' if isinstance(row, list) else json.dumps(row)[:40]}", f"$.instances[{i}]")
        for name, value in row.items():
            column = columns.get(name)
            if column is None:
                if name not in known:
                    raise RequestError(f"field {name!r} is not a column of the model's schema (its columns: "
                                       f"{', '.join(c.name for c in model_inputs(model))})",
                                       key(f"$.instances[{i}]", name))
                column = columns[name] = [None] * n
            column[i] = value
    return columns


def at_rows(err: RequestError) -> RequestError:
    """An error at $.instances.C[i]... named at the row the client sent: $.instances[i].C..."""
    return _renamed(err, "$.instances", lambda name, key, row, rest:
                    (None, None) if row is None else (f"$.instances[{row}]{key}{rest}", None))


def v1_answer(scores: np.ndarray, model, style: str, tf: bool, step: int) -> dict:
    """/v1/predict: {"scores", "step"} for columns, {"predictions", "step"} for rows. TF Serving's own
    route (tf): {"outputs"} for columns, {"predictions"} for rows, nothing else, as TF Serving answers."""
    if style == "inputs":
        value = scores if scores.ndim == 1 else {name: output_values(scores, model, name) for name in model.labels}
        return {"outputs": value} if tf else {"scores": value, "step": step}
    rows = scores if scores.ndim == 1 else [dict(zip(model.labels, row)) for row in scores.tolist()]
    return {"predictions": rows} if tf else {"predictions": rows, "step": step}


def tf_status(model, not_ready: str | None) -> dict:
    """GET /v1/models/{name}: TF Serving's model status (the version is the training step)."""
    status = {"error_code": "OK", "error_message": ""} if not_ready is None else \
        {"error_code": "UNAVAILABLE", "error_message": not_ready}
    return {"model_version_status": [{"version": str(model.step), "state": "AVAILABLE" if not_ready is None else "END",
                                      "status": status}]}


_TF_DTYPE = {"FP32": "DT_FLOAT", "INT64": "DT_INT64", "BYTES": "DT_STRING"}


def tf_metadata(name: str, model) -> dict:
    """GET /v1/models/{name}/metadata: TF Serving's signature "serving_default", one tensor per column."""
    def tensor(column: str, datatype: str) -> dict:
        return {"dtype": _TF_DTYPE[datatype], "tensor_shape": {"dim": [{"size": "-1", "name": ""}],
                                                                "unknown_rank": False}, "name": column}

    signature = {"inputs": {c.name: tensor(c.name, datatype(c)) for c in model_inputs(model)},
                 "outputs": {o: tensor(o, "FP32") for o in output_names(model)},
                 "method_name": "tensorflow/serving/predict"}
    return {"model_spec": {"name": name, "signature_name": "", "version": str(model.step)},
            "metadata": {"signature_def": {"signature_def": {"serving_default": signature}}}}


# -- v2: the Open Inference Protocol ------------------------------------------------------------------

_NUMPY = {"BOOL": "?", "INT8": "i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "UINT8": "u1",
          "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}
_DTYPES = {kind: np.dtype(code) for kind, code in _NUMPY.items()}
_INTEGERS = ("INT64", "INT32", "INT16", "INT8", "UINT64", "UINT32", "UINT16", "UINT8")
_ACCEPTED = {"number": ("FP32", "FP64", "FP16", *_INTEGERS), "int": _INTEGERS, "string": ("BYTES", *_INTEGERS),
             "sequence": ("BYTES",)}


def datatype(c) -> str:
    """The datatype a column's input is declared with: FP32, INT64 (integer ids) or BYTES."""
    return {"number": "FP32", "int": "INT64"}.get(_family(c), "BYTES")


def _family(c) -> str:
    if c.kind in ("label", "dense", "weight"):
        return "number"
    if c.kind == "categorical":
        return "int" if c.dtype == "int" else "string"
    return "sequence"


def v2_metadata(name: str, model) -> dict:
    return {"name": name, "versions": [str(model.step)], "platform": "deeprec",
            "inputs": [{"name": c.name, "datatype": datatype(c), "shape": [-1]} for c in model_inputs(model)],
            "outputs": [{"name": o, "datatype": "FP32", "shape": [-1]} for o in output_names(model)]}


def triton_config(name: str, model) -> dict:
    """GET /v2/models/{name}/config: Triton's model configuration (max_batch_size 0: shapes hold the rows)."""
    def tensor(column: str, kind: str) -> dict:
        return {"name": column, "data_type": f"TYPE_{'STRING' if kind == 'BYTES' else kind}", "dims": [-1]}

    return {"name": name, "platform": "deeprec", "backend": "deeprec", "max_batch_size": 0,
            "input": [tensor(c.name, datatype(c)) for c in model_inputs(model)],
            "output": [tensor(o, "FP32") for o in output_names(model)]}


def server_metadata() -> dict:
    """GET /v2 and gRPC's ServerMetadata: the server, its version, the protocol's extensions it serves."""
    import deeprec

    return {"name": "deeprec", "version": deeprec.__version__,
            "extensions": ["binary_tensor_data", "model_configuration"]}


class V2Request:
    """An inference request: columns for ServedModel.batch, and the outputs asked (name, binary)."""

    def __init__(self, request_id, columns: dict, order: dict, outputs: list):
        self.id, self.columns, self.order, self.outputs = request_id, columns, order, outputs


def v2_request(body: bytes, header_length: str | None, model, max_rows: int | None = None) -> V2Request:
    """Parse an infer body: JSON, or (Inference-Header-Content-Length) a JSON header followed by the
    binary inputs, in the order of the inputs that give `parameters.binary_data_size`."""
    binary = memoryview(b"")
    if header_length is not None:
        digits = header_length.strip()
        if not (digits.isascii() and digits.isdigit()) or int(digits) > len(body):
            raise RequestError(f"Inference-Header-Content-Length {header_length!r}: expected the JSON header's "
                               f"size in bytes, at most the body's {len(body)}")
        binary = memoryview(body)[int(digits):]
        body = body[:int(digits)]
    header = loads(body)
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list) or not header["inputs"]:
        raise RequestError("the body must be {\"inputs\": [{\"name\", \"datatype\", \"shape\", \"data\"}, ...]} "
                           "(the Open Inference Protocol)")
    inputs, offset = V2Inputs(model, max_rows), 0
    for k, tensor in enumerate(header["inputs"]):
        if not isinstance(tensor, dict):
            raise RequestError("expected an input {\"name\", \"datatype\", \"shape\", \"data\"}", f"$.inputs[{k}]")
        name, kind, parameters = tensor.get("name"), tensor.get("datatype"), tensor.get("parameters") or {}
        count = inputs.check(k, name, kind, tensor.get("shape"), parameters)
        size = parameters.get("binary_data_size")
        if size is None:
            values = tensor.get("data")
            if not (type(values) is list and len(values) == count and not (values and type(values[0]) is list)):
                values = json_values(values, name, tensor["shape"], f"$.inputs[{k}].data")  # nested, or not values
        else:
            path = f"$.inputs[{k}]"
            if "data" in tensor:
                raise RequestError(f"input {name!r}: both data and binary_data_size; give one", path)
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
                raise RequestError(f"input {name!r}: binary_data_size {json.dumps(size)}, {len(binary) - offset} "
                                   "bytes of binary data are left after the header and the inputs before",
                                   f"{path}.parameters.binary_data_size")
            values = binary_values(binary[offset:offset + size], kind, count, name, path)
            offset += size
        inputs.add(k, name, values)
    if offset != len(binary):
        raise RequestError(f"{len(binary) - offset} bytes of binary data after the inputs' (binary_data_size "
                           "of each binary input must add up to the body after the header)")
    return V2Request(header.get("id"), inputs.columns, inputs.order, requested_outputs(header, model))


def declared_datatypes(schema) -> dict[str, str]:
    """{input: the datatype it is declared with} (gRPC's lean reading takes exactly these)."""
    return {name: datatype(c) for name, c in schema.derived("v2_inputs", _inputs_of)[0].items()}


def _inputs_of(schema) -> tuple[dict, dict]:
    """({name: column}, {name: the datatypes it takes}) of the inputs a request gives (as model_inputs)."""
    inputs = {c.name: c for c in schema.columns if c.kind not in ("label", "ignore")}
    return inputs, {name: _ACCEPTED[_family(c)] for name, c in inputs.items()}


class V2Inputs:
    """The inputs of one infer request, checked one by one as they are read (HTTP's JSON header, gRPC's
    ModelInferRequest): each an input of the model, given once, of a datatype it takes, shaped [rows] or
    [rows, 1], all of one row count within max_rows, no shared memory. `columns` {name: values}, `order`
    {name: its index k in the request}."""

    def __init__(self, model, max_rows: int | None):
        self.inputs, self.accepted = model.schema.derived("v2_inputs", _inputs_of)
        self.max_rows = max_rows
        self.columns, self.order, self.rows = {}, {}, None

    def check(self, k: int, name, kind, shape, parameters) -> int:
        """The element count of input k (its rows), once its name, datatype, shape and parameters are checked.
        (The paths of errors are made only for an error: 39 inputs checked cost 76 us a request.)"""
        accepted = self.accepted.get(name) if isinstance(name, str) else None
        if accepted is None:
            raise RequestError(f"input {name!r} is not an input of the model (its inputs: {', '.join(self.inputs)})",
                               f"$.inputs[{k}].name")
        if name in self.columns:
            raise RequestError(f"input {name!r} is given twice (also $.inputs[{self.order[name]}])",
                               f"$.inputs[{k}].name")
        if kind not in accepted:
            c = self.inputs[name]
            raise RequestError(f"input {name!r}: datatype {json.dumps(kind)}, this input takes {datatype(c)} "
                               f"(or {', '.join(t for t in accepted if t != datatype(c)) or 'no other'})",
                               f"$.inputs[{k}].datatype")
        count = _shape(shape, name, k)
        if self.rows is None:
            _check_rows(count, self.max_rows, f"$.inputs[{k}].shape")  # before its data: a small body may claim many rows
            self.rows = count
        elif count != self.rows:
            raise RequestError(f"input {name!r}: {count} rows, the inputs before it have {self.rows}",
                               f"$.inputs[{k}].shape")
        if type(parameters) is not dict or "shared_memory_region" in parameters:
            raise RequestError(f"input {name!r}: parameters must be an object; shared memory is not served "
                               "(send the data in the body)", f"$.inputs[{k}].parameters")
        return count

    def add(self, k: int, name: str, values) -> None:
        self.columns[name], self.order[name] = values, k


def _shape(shape, name: str, k: int) -> int:
    if type(shape) is list and type(shape[0] if shape else None) is int and shape[0] >= 0 and \
            (len(shape) == 1 or len(shape) == 2 and type(shape[1]) is int and shape[1] == 1):
        return shape[0]
    raise RequestError(f"input {name!r}: shape {json.dumps(shape)}, expected [rows] or [rows, 1] (one value "
                       "per row; a sequence is one BYTES element per row, its ids joined by the separator)",
                       f"$.inputs[{k}].shape")


def json_values(data, name: str, shape: list, path: str) -> list:
    """The values of `data`, flat (row-major) if the client nested them as the shape [rows, 1]."""
    if not isinstance(data, list):
        raise RequestError(f"input {name!r}: expected data (a list of values) or parameters.binary_data_size", path)
    if data and isinstance(data[0], list) and (len(shape) == 2 or len(data) != shape[0]):
        data = [v for row in data for v in (row if isinstance(row, list) else [row])]
    if len(data) != shape[0]:
        raise RequestError(f"input {name!r}: {len(data)} values, the shape {json.dumps(shape)} says {shape[0]} (a "
                           "sequence: one element per row, its ids joined by the separator or a list)", path)
    return data


def binary_values(chunk: memoryview, kind: str, count: int, name: str, path: str):
    """Raw little-endian values; BYTES: each element a 4-byte little-endian length, then its bytes."""
    if kind == "BYTES":
        return _bytes_elements(chunk, count, name, path)
    dtype = _DTYPES[kind]
    if len(chunk) != count * dtype.itemsize:
        raise RequestError(f"input {name!r}: {len(chunk)} bytes of binary data, {count} {kind} values are "
                           f"{count * dtype.itemsize}", f"{path}.parameters.binary_data_size")
    return np.frombuffer(chunk, dtype)


def _bytes_elements(chunk: memoryview, count: int, name: str, path: str) -> list:
    split = _C.bytes_elements(chunk, count)  # one native pass (Python per element: 0.85 ms for 64 DLRM rows)
    if isinstance(split, list):
        return split
    i, at = split
    if i < count:
        raise RequestError(f"input {name!r}: the binary data ends in BYTES element {i} of {count} (each "
                           "element: a 4-byte little-endian length, then its bytes)", f"{path}.data[{i}]")
    raise RequestError(f"input {name!r}: {len(chunk) - at} bytes after its {count} BYTES elements",
                       f"{path}.parameters.binary_data_size")


def v2_columns(request: V2Request, model) -> dict:
    """The columns as ServedModel.batch takes them: numbers as the numpy arrays read from the body (no
    Python per value), BYTES as bytes (a sequence's as UTF-8 text: its ids are split as text)."""
    sequences = {c.name for c in model.schema.columns if c.kind == "sequence"}
    columns = {}
    for name, values in request.columns.items():
        if name in sequences and values and isinstance(values[0], bytes):
            values = [_text(v, name, request.order[name], i) for i, v in enumerate(values)]
        columns[name] = values
    return columns


def _text(value: bytes, name: str, k: int, i: int) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError as err:
        raise RequestError(f"input {name!r}: a BYTES element that is not UTF-8 text ({err.reason})",
                           f"$.inputs[{k}].data[{i}]") from None


def at_inputs(err: RequestError, request: V2Request) -> RequestError:
    """An error at $.inputs.C[i]... named at the input the client sent: $.inputs[k].data[i]..."""
    def where(name, key, row, rest):
        k = request.order.get(name)
        if k is None:
            return None, None
        reason = "input" + err.reason[len("field"):] if err.reason.startswith("field ") else None
        return (f"$.inputs[{k}]" if row is None else f"$.inputs[{k}].data[{row}]{rest}"), reason

    return _renamed(err, "$.inputs", where)


def requested_outputs(header: dict, model) -> list[tuple[str, bool]]:
    """(name, binary) of each output to answer; binary if the request asks (binary_data_output for all,
    an output's parameters.binary_data for it)."""
    parameters = header.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise RequestError("parameters must be an object", "$.parameters")
    every = parameters.get("binary_data_output") is True
    names = output_names(model)
    asked = header.get("outputs")
    if asked is None:
        return [(name, every) for name in names]
    if not isinstance(asked, list):
        raise RequestError("outputs must be a list of {\"name\": ...}", "$.outputs")
    outputs = []
    for j, output in enumerate(asked):
        name = output.get("name") if isinstance(output, dict) else None
        if name not in names:
            raise RequestError(f"output {name!r} is not an output of the model (its outputs: {', '.join(names)})",
                               f"$.outputs[{j}].name")
        wanted = output.get("parameters") or {}
        if not isinstance(wanted, dict) or wanted.get("classification"):
            raise RequestError(f"output {name!r}: parameters must be an object; classification is not served",
                               f"$.outputs[{j}].parameters")
        outputs.append((name, wanted.get("binary_data", every) is True))
    return outputs


def v2_answer(name: str, model, request: V2Request, scores: np.ndarray) -> tuple[bytes, dict]:
    """The infer answer and its headers: JSON, or a JSON header then the binary outputs."""
    outputs, blobs = [], []
    for output, binary in request.outputs:
        values = output_values(scores, model, output)
        tensor = {"name": output, "datatype": "FP32", "shape": [len(values)]}
        if binary:
            blobs.append(values.astype("<f4", copy=False).tobytes())
            tensor["parameters"] = {"binary_data_size": len(blobs[-1])}
        else:
            tensor["data"] = values
        outputs.append(tensor)
    answer = {"model_name": name, "model_version": str(model.step), "outputs": outputs}
    if request.id is not None:
        answer["id"] = request.id
    text = dumps(answer)
    if not blobs:
        return text, {"content-type": "application/json"}
    return text + b"".join(blobs), {"content-type": "application/octet-stream",
                                    "inference-header-content-length": str(len(text))}
