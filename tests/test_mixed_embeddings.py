"""A model mixing every kind of embedding a user writes (tests/custom_models.py MixedEmbeddings: an
EmbeddingVariable shared under two names, one over a crossed feature, nn.Embedding over hash
buckets, a bucketized dense value embedded) through the whole engine, by the CLI: local training
with SmartStage and resume, a PS job, collective training, tiered storage; each checkpoint exported,
and the export scores every row of the data as `deeprec evaluate --predictions` does."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from deeprec.cli import sample_path
from deeprec.data import open_reader, resolve_schema
from test_own_model import _serve_one

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = os.path.join(ROOT, "tests", "custom_models.py") + ":MixedEmbeddings"
TRAIN = ["train", "--model", SPEC, "--data", sample_path(), "--batch-size", "16"]

pytestmark = pytest.mark.slow


def deeprec(*args, cwd, timeout=600):
    done = subprocess.run([sys.executable, "-m", "deeprec.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def export_scores_as_evaluate(ck, tmp, compile: bool = False):
    """Export the checkpoint `ck`; its scores of every sample row equal `deeprec evaluate --predictions`
    (1e-6: the program may order a sum otherwise). Returns (the export folder, the predictions)."""
    from deeprec.serving import load

    out, predictions = tmp / f"export-{ck.name}", tmp / f"predictions-{ck.name}.csv"
    deeprec("export", "--checkpoint", str(ck), "--out", str(out), *([] if compile else ["--no-compile"]), cwd=tmp)
    evaluated = deeprec("evaluate", "--checkpoint", str(ck), "--data", sample_path(), "--predictions",
                        str(predictions), cwd=tmp)
    want = torch.tensor([float(line) for line in predictions.read_text().splitlines()])
    served = load(str(out))
    assert served.module.evs.C1 is served.module.evs.C2  # the shared variable: one module in the export too
    batch = next(iter(open_reader([sample_path()], 10 ** 6, schema=resolve_schema([sample_path()], None))))
    torch.testing.assert_close(served(batch), want, rtol=0, atol=1e-6)
    return out, want, json.loads(evaluated.stdout.strip().splitlines()[-1])


def test_local_training_with_smart_stage_resumes_exactly_exports_and_serves(tmp_path):
    from deeprec.checkpoint import latest_checkpoint, load_checkpoint
    from test_serving import _json_rows

    first = deeprec(*TRAIN, "--steps", "6", "--smart-stage", "--checkpoint-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert "SmartStage" in first.stdout + first.stderr
    resumed = deeprec(*TRAIN, "--steps", "10", "--smart-stage", "--checkpoint-dir", str(tmp_path / "run"),
                      "--resume", cwd=tmp_path)
    assert "at step 6" in resumed.stderr
    deeprec(*TRAIN, "--steps", "10", "--smart-stage", "--checkpoint-dir", str(tmp_path / "straight"), cwd=tmp_path)
    a = load_checkpoint(latest_checkpoint(str(tmp_path / "run")))["model"]
    b = load_checkpoint(latest_checkpoint(str(tmp_path / "straight")))["model"]
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # exactly
    assert "evs.C1.keys" in a and not any(k.startswith("evs.C2.") for k in a)  # the shared variable saved once
    out, want, _ = export_scores_as_evaluate(tmp_path / "run", tmp_path, compile=True)
    schema = resolve_schema([sample_path()], None)
    scores = _serve_one(out, _json_rows(sample_path(), schema, 3), tmp_path)  # the compiled package, over HTTP
    torch.testing.assert_close(torch.tensor(scores), want[:3], rtol=0, atol=1e-6)


def test_a_ps_job_exports_and_evaluates(tmp_path):
    """Failed before: the PS checkpoint held the shared variable once ("checkpoint does not fit the
    model: missing ['evs.C2.keys']")."""
    done = deeprec("launch", "--ps", "1", "--workers", "2", "--", *TRAIN, "--steps", "8", "--checkpoint-dir",
                   str(tmp_path / "ps"), cwd=tmp_path)
    assert "2/2 workers succeeded" in done.stdout
    export_scores_as_evaluate(tmp_path / "ps", tmp_path)


def test_collective_training_exports_and_evaluates(tmp_path):
    done = deeprec("launch", "--workers", "2", "--collective", "--", *TRAIN, "--eval-data", sample_path(), "--steps",
                   "8", "--checkpoint-dir", str(tmp_path / "collective"), cwd=tmp_path)
    assert "2/2 workers succeeded" in done.stdout
    _, _, metrics = export_scores_as_evaluate(tmp_path / "collective", tmp_path)
    assert f"eval AUC {metrics['auc']:.4f}" in done.stdout  # the merged checkpoint scores as the ranks did


def test_tiered_storage_exports_and_evaluates(tmp_path):
    done = deeprec(*TRAIN, "--steps", "12", "--storage", "ssd", "--dram-bytes", "34000", "--storage-path",
                   str(tmp_path / "disk"), "--checkpoint-dir", str(tmp_path / "tiered"), cwd=tmp_path)
    disk_rows = re.search(r"tiered storage +│ DRAM [\d,]+ rows \([^)]*\), disk ([\d,]+) rows", done.stdout)
    assert disk_rows and int(disk_rows.group(1).replace(",", "")) > 0, done.stdout[-2000:]  # the budget pushed rows out
    export_scores_as_evaluate(tmp_path / "tiered", tmp_path)
