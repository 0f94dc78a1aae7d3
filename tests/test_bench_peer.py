"""bench/serving_peer.py: the ONNX Runtime peer scores what the deeprec export scores, so its row in
bench/serving.py can never compare against a different model."""
import os
import sys

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")  # torch.onnx.export(dynamo=True)

import deeprec as dr  # noqa: E402
from deeprec.cli import sample_path  # noqa: E402
from deeprec.trainer import TrainConfig, Trainer  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import serving_peer  # noqa: E402
from test_serving import _json_rows  # noqa: E402


@pytest.mark.slow(reason="trains a DLRM 3 steps, exports it (traced) and to ONNX (about 10 s)")
def test_onnx_peer_scores_as_the_export(tmp_path):
    data = sample_path("criteo_sample.txt")
    trainer = Trainer(TrainConfig.create(model="dlrm", data=[data], steps=3, batch_size=64, embedding="variable",
                                         progress=False))
    trainer.train()
    path = dr.export(trainer.model, str(tmp_path / "dlrm"), schema=trainer.schema, model_name="dlrm", step=3,
                     compile=False, progress=False)
    with pytest.warns(dr.serving.CompiledFallbackWarning):  # no package: the traced program scores
        served = dr.serving.load(path)
    rows = _json_rows(data, trainer.schema, 12)
    model, indexer = serving_peer.plain_dlrm(served)
    session = serving_peer.onnx_session(model, indexer(served.batch(rows)), str(tmp_path / "dlrm.onnx"))
    # sample rows, and rows with unseen ids, ids and dense values left out
    checked = serving_peer.check(served, model, indexer, session, serving_peer.check_rows(served, rows))
    assert checked["rows"] == 15 and checked["max_abs_diff_onnxruntime"] <= 1e-5
    one = {k: v[:1] for k, v in rows.items()}  # 1 row: deeprec scores it twice (torch.export), ONNX Runtime once
    assert serving_peer.check(served, model, indexer, session, one)["rows"] == 1
    # the unseen ids read the variables' missing value, not a trained row
    dense, ids = indexer(served.batch(serving_peer.check_rows(served, rows)))
    assert (ids[-3] == torch.tensor([indexer.offsets[t] + indexer.real[t] for t in range(ids.shape[1])])).all()

    # the check catches a peer that computes something else: each id one row off
    class Shifted:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, batch):
            dense, ids = self.inner(batch)
            return dense, (ids + 1).clamp_max(indexer.zero_row)

    with pytest.raises(AssertionError, match="differs from the export"):
        serving_peer.check(served, model, Shifted(indexer), session, rows)
