import base64
import json
import pathlib

import numpy as np
import pytest
import torch
import torch.fx

from deeprec import Ragged, ops
from deeprec.errors import ConfigError


MASK = (1 << 64) - 1
FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def _rotl(x, b):
    return ((x << b) | (x >> (64 - b))) & MASK


def reference_hash(msg: bytes) -> int:
    """SipHash-2-4 (key b"0123456789123456") then the splitmix64 finalizer,
    written out from the algorithms' definitions: what hash="siphash" promises."""
    key = b"0123456789123456"
    k0, k1 = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D, k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]

    def sipround():
        v[0] = (v[0] + v[1]) & MASK; v[1] = _rotl(v[1], 13) ^ v[0]; v[0] = _rotl(v[0], 32)  # noqa: E702
        v[2] = (v[2] + v[3]) & MASK; v[3] = _rotl(v[3], 16) ^ v[2]  # noqa: E702
        v[0] = (v[0] + v[3]) & MASK; v[3] = _rotl(v[3], 21) ^ v[0]  # noqa: E702
        v[2] = (v[2] + v[1]) & MASK; v[1] = _rotl(v[1], 17) ^ v[2]; v[2] = _rotl(v[2], 32)  # noqa: E702

    end = len(msg) - len(msg) % 8
    words = [int.from_bytes(msg[i:i + 8], "little") for i in range(0, end, 8)]
    words.append(((len(msg) & 0xFF) << 56) | int.from_bytes(msg[end:], "little"))
    for m in words:
        v[3] ^= m
        sipround()
        sipround()
        v[0] ^= m
    v[2] ^= 0xFF
    for _ in range(4):
        sipround()
    x = v[0] ^ v[1] ^ v[2] ^ v[3]
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def test_hash_is_a_fixed_function_of_the_bytes():
    # Stability across runs, processes and machines follows from the hash being
    # this exact, key-fixed function; a library change that broke it fails here.
    # Lengths cover the vector lanes (groups of 8, mixed lengths) and the one-by-one tail.
    values = [b"05db9164", b"", b"68fd1e64", "ünï".encode(), b"x" * 100, b"1234567"] * 3 + \
        [bytes(range(n)) for n in range(70)]
    col = Ragged.from_strings(values)
    buckets = ops.string_to_hash_bucket(col, 10000).tolist()
    assert buckets == [reference_hash(v) % 10000 for v in values]
    assert ops.string_to_hash_bucket(col, 2**63 - 1).tolist() == [reference_hash(v) % (2**63 - 1) for v in values]
    keys = ops.string_to_hash_key(col).tolist()
    assert keys == [reference_hash(v) >> 1 for v in values]
    assert keys[0] == 15920079977298304993 >> 1


def test_siphash_equals_pandas_hash_array():
    """deeprec <= 0.1 hashed with pandas.util.hash_array: checkpoints keep their bucket ids."""
    pd = pytest.importorskip("pandas")
    values = [f"{i:08x}".encode() for i in range(3000)] + [b"", "ünï".encode(), b"y" * 77]
    expected = pd.util.hash_array(np.array(values, dtype=object), categorize=False)
    got = ops.string_to_hash_key(Ragged.from_strings(values)).numpy().astype(np.uint64)
    assert (got == expected >> np.uint64(1)).all()


def test_farmhash_equals_tensorflow_to_hash_bucket_fast():
    """Fixture made by TensorFlow 2.21 (command inside the file): every length branch of Fingerprint64."""
    fixture = json.loads((FIXTURES / "tf_farmhash.json").read_text())
    strings = [base64.b64decode(s) for s in fixture["strings_base64"]]
    col = Ragged.from_strings(strings)
    assert len(fixture["buckets"]) == 6
    for n, expected in fixture["buckets"].items():
        assert ops.string_to_hash_bucket(col, int(n), hash="farmhash").tolist() == expected, n


def test_many_columns_in_one_call_equal_one_by_one():
    cols = [Ragged.from_strings([f"{f}-{i}".encode() for i in range(300)]) for f in range(5)]
    sizes = [10, 100, 1000, 7, 2**40]
    many = ops.string_to_hash_bucket(cols, sizes, hash="farmhash")
    assert isinstance(many, tuple) and len(many) == 5
    for col, n, got in zip(cols, sizes, many):
        assert torch.equal(got, ops.string_to_hash_bucket(col, n, hash="farmhash"))
    assert [k.tolist() for k in ops.string_to_hash_key(cols)] == [ops.string_to_hash_key(c).tolist() for c in cols]


def test_sliced_arrow_columns_hash_like_fresh_ones():
    import pyarrow as pa

    array = pa.array([b"a", b"bb", b"", b"ccc", b"dddd"] * 10, pa.binary())
    sliced = Ragged.from_arrow(array.slice(3, 20))
    assert sliced.offsets[0] == 0 and sliced.tolist() == array.slice(3, 20).to_pylist()
    assert torch.equal(ops.string_to_hash_bucket(sliced, 97),
                       ops.string_to_hash_bucket(Ragged.from_strings(array.slice(3, 20).to_pylist()), 97))
    assert Ragged.from_arrow(pa.array(["ünï"])).tolist() == ["ünï".encode()]  # utf8 hashes as its bytes


def test_hash_buckets_in_range_and_spread():
    values = Ragged.from_strings([f"{i:08x}".encode() for i in range(20000)])
    for hash in ops.HASHES:
        ids = ops.string_to_hash_bucket(values, 100, hash=hash)
        assert ids.dtype == torch.int64 and ids.min() >= 0 and ids.max() < 100
        counts = torch.bincount(ids, minlength=100).float()
        assert counts.min() > 140 and counts.max() < 260  # ~200 each


def test_bad_arguments_are_named():
    col = Ragged.from_strings([b"a"])
    with pytest.raises(ConfigError, match=r"num_buckets must be an int in \[1, 2\*\*63 - 1\]"):
        ops.string_to_hash_bucket(col, 0)
    with pytest.raises(ConfigError, match="hash='md5' is not allowed; choose one of 'siphash', 'farmhash'"):
        ops.string_to_hash_bucket(col, 10, hash="md5")
    with pytest.raises(ConfigError, match="takes a string column.*Ragged.from_strings"):
        ops.string_to_hash_bucket(np.array([b"a"], dtype=object), 10)
    with pytest.raises(RuntimeError, match="offsets must be non-decreasing"):
        torch.ops.deeprec.string_to_hash_bucket([col.values], [torch.tensor([0, 5])], [10], "siphash")
    with pytest.raises(RuntimeError, match="column 1 has 2 rows, column 0 has 1"):
        ops.cross_hash_bucket([col, Ragged.from_strings([b"a", b"b"])], 10)


def test_cross_hash_bucket_hashes_the_joined_string():
    a, b = Ragged.from_strings([b"x", b"", "ü".encode()]), Ragged.from_strings([b"1", b"2", b"3"])
    joined = Ragged.from_strings([b"x_X_1", b"_X_2", "ü_X_3".encode()])
    for hash in ops.HASHES:
        assert torch.equal(ops.cross_hash_bucket([a, b], 1000, hash=hash), ops.string_to_hash_bucket(joined, 1000, hash=hash))


def test_dedup_equals_torch_unique():
    ids = torch.randint(-5, 50, (1000,))
    unique, inverse = ops.dedup(ids)
    expected_unique, expected_inverse = torch.unique(ids, return_inverse=True)
    assert torch.equal(unique, expected_unique) and torch.equal(inverse, expected_inverse)
    assert torch.equal(unique[inverse], ids)


def test_ops_release_the_gil():
    """A thread hashing strings must not stop Python code in another thread from running."""
    import threading
    import time

    col = Ragged.from_strings([bytes(200) for _ in range(200_000)])
    done = threading.Event()
    ticks = []

    def python_loop():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    thread = threading.Thread(target=python_loop)
    thread.start()
    time.sleep(0.01)
    start = time.perf_counter()
    for _ in range(5):
        ops.string_to_hash_key(col)
    elapsed = time.perf_counter() - start
    done.set()
    thread.join()
    during = [t for t in ticks if start <= t <= start + elapsed]
    assert elapsed > 0.02 and len(during) >= elapsed / 0.005  # the other thread kept ticking


def test_dense_ops():
    x = torch.tensor([float("nan"), -3.0, 0.0, float(np.e - 1)])
    filled = ops.fill_missing(x, 5.0)
    assert filled.tolist() == [5.0, -3.0, 0.0, pytest.approx(np.e - 1)]
    assert ops.log_normalize(filled).tolist() == [pytest.approx(np.log(6.0)), 0.0, 0.0, pytest.approx(1.0)]
    # TF Bucketize semantics: boundaries [0, 10, 100]
    b = ops.bucketize(torch.tensor([-5.0, 0.0, 5.0, 10.0, 150.0]), [0.0, 10.0, 100.0])
    assert b.tolist() == [0, 1, 1, 2, 3]
    assert ops.bucketize(torch.tensor([float("nan"), 0.1]), [0.1]).tolist() == [1, 1]
    with pytest.raises(RuntimeError, match="strictly increasing"):
        ops.bucketize(torch.zeros(2), [1.0, 1.0])


class UsesEveryOp(torch.nn.Module):
    def forward(self, batch):
        ids = ops.string_to_hash_bucket(batch["C1"], 50)
        dense = ops.log_normalize(ops.fill_missing(batch["I1"], 0.0))
        return ids + ops.bucketize(dense, [0.5, 2.0])


def test_each_op_is_a_single_traced_node():
    graph = torch.fx.symbolic_trace(UsesEveryOp()).graph
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    for fn in (ops.string_to_hash_bucket, ops.fill_missing, ops.log_normalize, ops.bucketize):
        assert targets.count(fn) == 1 and ops.is_op(fn)
    assert not any(n.op == "call_function" and n.target in (torch.isnan, torch.log1p) for n in graph.nodes)


def test_traced_graph_computes_the_same():
    batch = {"C1": Ragged.from_strings([b"a", b"b", b""]), "I1": torch.tensor([1.0, float("nan"), 30.0])}
    assert torch.equal(torch.fx.symbolic_trace(UsesEveryOp())(batch), UsesEveryOp()(batch))


def test_user_op_decorator_and_stateful_flag():
    calls = []

    @ops.op(stateful=True)
    def count(x):
        calls.append(1)
        return x + len(calls)

    class M(torch.nn.Module):
        def forward(self, x):
            return count(x) * 2

    gm = torch.fx.symbolic_trace(M())
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is count)
    assert ops.is_stateful_op(node.target) and not ops.is_stateful_op(ops.fill_missing)
    assert gm(torch.ones(2)).tolist() == [4.0, 4.0] and len(calls) == 1
