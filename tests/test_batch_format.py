"""The raw batch is tensors only: it collates, moves, crosses processes, and exports."""
import pytest
import torch
from torch.utils.data import DataLoader

import deeprec as dr
from deeprec import ops
from deeprec.data import CriteoReader, collate
from deeprec.models import build_model
from deeprec.runtime.stage_process import decode, encode


def _tensors_only(value) -> bool:
    if isinstance(value, dict):
        return all(_tensors_only(v) for v in value.values())
    if isinstance(value, dr.Ragged):
        return _tensors_only(value.values) and isinstance(value.offsets, torch.Tensor)
    return isinstance(value, torch.Tensor)


def _rows(batches, column):
    return [v for b in batches for v in b[column].tolist()]


def test_reader_batches_hold_only_tensors(sample):
    batch = next(iter(CriteoReader(sample, 32)))
    assert _tensors_only(batch)
    c1 = batch["C1"]
    assert c1.values.dtype == torch.uint8 and c1.offsets.dtype == torch.int64 and c1.rows == 32
    assert c1.offsets[0] == 0 and c1.offsets[-1] == c1.values.numel()


def test_dataloader_workers_read_every_row_once(sample):
    plain = list(CriteoReader(sample, 16))
    for workers in (1, 2):
        loaded = list(DataLoader(CriteoReader(sample, 16), batch_size=None, num_workers=workers))
        assert sorted(_rows(loaded, "C3")) == sorted(_rows(plain, "C3"))
        assert sorted(torch.cat([b["I2"] for b in loaded]).nan_to_num(-9).tolist()) == \
            sorted(torch.cat([b["I2"] for b in plain]).nan_to_num(-9).tolist())
    grouped = list(DataLoader(CriteoReader(sample, 16), batch_size=4, collate_fn=collate, num_workers=1))
    assert [b["label"].shape[0] for b in grouped] == [64, 64, 64, 8]
    assert _rows(grouped, "C7") == _rows(plain, "C7") and all(_tensors_only(b) for b in grouped)


def test_collate_rows_and_sequences():
    rows = [{"label": 1.0, "item": b"a", "hist": [3, 4]}, {"label": 0.0, "item": "b", "hist": []}]
    batch = collate(rows)
    assert batch["label"].tolist() == [1.0, 0.0] and batch["item"].tolist() == [b"a", b"b"]
    assert batch["hist"].values.tolist() == [3, 4] and batch["hist"].offsets.tolist() == [0, 2, 2]
    nested = collate([{"s": dr.Ragged.from_lists([["x", "yy"]])}, {"s": dr.Ragged.from_lists([[], ["z"]])}])["s"]
    assert nested.tolist() == [[b"x", b"yy"], [], [b"z"]]
    with pytest.raises(dr.ConfigError, match="item 1 has columns"):
        collate([{"a": 1}, {"b": 2}])


def test_batches_move_and_cross_the_process_wire(sample):
    batch = next(iter(CriteoReader(sample, 8)))
    moved = {k: v.to("cpu", torch.int64) if isinstance(v, dr.Ragged) else v for k, v in batch.items()}
    assert isinstance(moved["C1"], dr.Ragged) and moved["C1"].values.dtype == torch.int64
    seq = dr.Ragged.from_lists([["a"], ["b", "c"]])
    chunks, offset = [], [0]
    spec = encode({"batch": batch, "seq": seq}, chunks, offset)
    back = decode(spec, torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8))
    assert back["batch"]["C9"].tolist() == batch["C9"].tolist() and isinstance(back["seq"].values, dr.Ragged)
    assert back["seq"].tolist() == [[b"a"], [b"b", b"c"]]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ragged_pins_and_moves_to_cuda(sample):
    c1 = next(iter(CriteoReader(sample, 8)))["C1"]
    pinned = c1.pin_memory()
    assert pinned.values.is_pinned() and pinned.offsets.is_pinned()
    on_gpu = pinned.to("cuda", non_blocking=True)
    assert on_gpu.values.is_cuda and ops.string_to_hash_bucket(on_gpu, 100).is_cuda
    assert torch.equal(ops.string_to_hash_bucket(on_gpu, 100).cpu(), ops.string_to_hash_bucket(c1, 100))


class Features(torch.nn.Module):
    """Preprocessing only: what serving needs exported with the model."""

    def forward(self, batch):
        ids = ops.string_to_hash_bucket([batch["C1"], batch["C2"]], [1000, 50], hash="farmhash")
        key = ops.string_to_hash_key(batch["C3"])
        crossed = ops.cross_hash_bucket([batch["C1"], batch["C2"]], 77)
        bucket = ops.bucketize(ops.fill_missing(batch["I1"]), [0.0, 1.0, 10.0])
        unique, inverse = ops.dedup(ids[0])
        return ids[0] + ids[1] + crossed + bucket + key % 3, unique[inverse]


def test_torch_export_captures_the_feature_ops(sample):
    batch = next(iter(CriteoReader(sample, 16)))
    inputs = {k: batch[k] for k in ("C1", "C2", "C3", "I1")}
    exported = torch.export.export(Features(), (inputs,), strict=False)
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert {"deeprec.string_to_hash_bucket.default", "deeprec.string_to_hash_key.default",
            "deeprec.cross_hash_bucket.default", "deeprec.bucketize.default", "deeprec.dedup.default"} <= targets
    other = {k: batch[k] for k in inputs}  # same shapes, the exported program recomputes
    for got, want in zip(exported.module()(other), Features()(other)):
        assert torch.equal(got, want)


def test_torch_compile_has_no_graph_break_on_the_ops(sample):
    torch._dynamo.reset()
    batch = next(iter(CriteoReader(sample, 16)))
    inputs = {k: batch[k] for k in ("C1", "C2", "C3", "I1")}
    # dedup's output size depends on the data, like torch.unique: dynamo captures such ops when asked
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        explanation = torch._dynamo.explain(Features())(inputs)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_dlrm_forward_on_moved_batch_equals(sample):
    torch.manual_seed(0)
    model = build_model("dlrm", hash_buckets=1000)
    batch = next(iter(CriteoReader(sample, 16)))
    moved = {k: v.to("cpu") for k, v in batch.items()}
    assert torch.equal(model(batch)["logits"], model(moved)["logits"])
