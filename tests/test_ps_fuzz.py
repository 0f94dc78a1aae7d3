"""Property-based fuzzing of the PS wire format and every method (hypothesis): whatever
arrives, the PS answers with a status that names the problem, never UNKNOWN or INTERNAL,
and keeps serving."""
import json
import struct

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deeprec.distributed import PSClient
from deeprec.distributed.ps.shard import METHODS, SERVICE
from deeprec.distributed.ps.wire import DTYPES, unpack

from conftest import start_ps  # noqa: E402

ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
NAMES = st.sampled_from(["emb", "w", "nope", "", "x" * 300])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_subnormal=False),
                    st.text(max_size=8))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                    st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                    max_leaves=12)
SPEC = st.fixed_dictionaries({}, optional={
    "name": st.one_of(NAMES, JSON), "kind": st.one_of(st.sampled_from(["embedding", "dense"]), JSON),
    "dim": st.one_of(st.integers(-5, 20_000), JSON), "lr": st.one_of(st.floats(allow_nan=True, allow_subnormal=False), JSON),
    "optimizer": st.one_of(st.sampled_from(["adagrad", "adam", "sgd", "ftrl", "nope"]), JSON)})
TENSOR_SPEC = st.fixed_dictionaries({}, optional={
    "dtype": st.one_of(st.sampled_from(list(DTYPES)), JSON),
    "shape": st.one_of(st.lists(st.integers(-3, 2**40), max_size=4), JSON),
    "off": st.one_of(st.integers(-8, 4096), JSON), "n": st.one_of(st.integers(-8, 4096), JSON)})
TENSOR_NAMES = st.sampled_from(["keys", "counts", "grads/4", "grads/3", "init/w", "dense/w", "defaults/emb",
                                "push.keys", "push.counts", "push.grads/4", "pull.keys", "pull.counts",
                                "emb/emb/keys", "dense_slot/w/accumulator"])
SECTION = st.fixed_dictionaries({}, optional={"embeddings": st.one_of(st.lists(NAMES, max_size=3), JSON),
                                              "dense": st.one_of(st.lists(NAMES, max_size=2), JSON), "train": JSON})
HEADER = st.fixed_dictionaries({}, optional={
    "variables": st.one_of(st.lists(SPEC, max_size=3), JSON), "embeddings": st.one_of(st.lists(NAMES, max_size=3), JSON),
    "dense": st.one_of(st.lists(NAMES, max_size=2), JSON), "push": st.one_of(SECTION, JSON),
    "pull": st.one_of(SECTION, JSON),
    "train": JSON, "step": st.one_of(st.integers(-3, 10), JSON), "workers": st.one_of(st.integers(-3, 4), JSON),
    "tensors": st.one_of(st.dictionaries(TENSOR_NAMES, TENSOR_SPEC, max_size=3), JSON)})


def message(header: dict, payload: bytes) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<I", len(head)) + head + payload


@pytest.fixture(scope="module")
def ps():
    proc, address = start_ps()
    client = PSClient([address], deadline_s=20)
    client.register({"emb": 4}, {"w": torch.ones(3)})
    channel = grpc.insecure_channel(address)
    calls = {m: channel.unary_unary(f"/{SERVICE}/{m}") for m in METHODS}
    yield proc, calls
    channel.close()
    client.close()
    proc.kill()
    proc.wait(10)


def answer(calls, method: str, request: bytes) -> None:
    try:
        calls[method](request, timeout=5)
    except grpc.RpcError as err:
        assert err.code() in ALLOWED, (method, err.code(), err.details())


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(METHODS), request=st.binary(max_size=64))
def test_random_bytes_never_break_the_ps(ps, method, request):
    answer(ps[1], method, request)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(METHODS), header=HEADER, payload=st.binary(max_size=256))
def test_structured_requests_get_a_named_status(ps, method, header, payload):
    answer(ps[1], method, message(header, payload))


def test_the_fuzzed_ps_still_serves(ps):
    proc, calls = ps
    assert proc.poll() is None
    assert "shard" in unpack(calls["Health"](message({}, b""), timeout=5))[0]
