"""Your own model gets the whole engine: the trainer, the CLI, checkpoints, export, serving, a PS job,
signals. The model is examples/custom_model.py (EmbeddingVariables in a ModuleDict and an MLP)."""
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from deeprec.errors import ConfigError
from deeprec.data import resolve_schema
from deeprec.models.spec import load_model, resolve

from test_serving import _json_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "custom_model.py")
SPEC = f"{EXAMPLE}:ClickModel"


def deeprec(*args, cwd, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "deeprec.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def test_model_specs_resolve_and_fail_clearly(tmp_path, sample):
    schema = resolve_schema([sample], None)
    model = load_model(SPEC, schema, dim=4)  # [model_overrides] reach the constructor
    assert model.embeddings["C1"].embedding_dim == 4
    assert resolve("deeprec.models.dlrm:DLRM").__name__ == "DLRM"
    (tmp_path / "fn.py").write_text("import torch\ndef make():\n    return torch.nn.Linear(2, 1)\n"
                                    "def bad():\n    return 3\n")
    assert isinstance(load_model(f"{tmp_path}/fn.py:make", schema), torch.nn.Linear)  # no schema argument
    with pytest.raises(ConfigError, match="returned a int, not a torch.nn.Module"):
        load_model(f"{tmp_path}/fn.py:bad")
    with pytest.raises(ConfigError, match="has no attribute 'Nope'.*defines: bad, make"):
        resolve(f"{tmp_path}/fn.py:Nope")
    with pytest.raises(ConfigError, match="no file"):
        resolve("missing.py:Model")
    with pytest.raises(ConfigError, match="cannot import 'no_such_pkg.models'"):
        resolve("no_such_pkg.models:Model")
    with pytest.raises(ConfigError, match="takes no argument 'width'"):
        load_model(SPEC, schema, width=3)


def test_trainer_takes_a_model_object_and_checks_its_outputs(sample):
    from deeprec.trainer import TrainConfig, Trainer

    sys.path.insert(0, os.path.dirname(EXAMPLE))
    try:
        from custom_model import ClickModel
    finally:
        sys.path.remove(os.path.dirname(EXAMPLE))
    cfg = TrainConfig(data=[sample], steps=3, batch_size=16, progress=False, eval_fraction=0.2)
    result = Trainer(cfg, model=ClickModel(resolve_schema([sample], None), dim=4)).train()
    assert result["steps"] == 3 and 0.0 <= result["eval"]["auc"] <= 1.0

    class NoLogits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, batch):
            return {"loss": (self.w * batch["I1"].nan_to_num()).sum()}

    with pytest.raises(ConfigError, match="must return a dict with 'loss'.*and 'logits'"):
        Trainer(TrainConfig(data=[sample], steps=2, batch_size=16, progress=False), model=NoLogits()).train()


def test_resume_below_done_steps_is_refused_before_training(tmp_path, sample):
    from deeprec.trainer import TrainConfig, Trainer

    common = dict(model="wdl", data=[sample], batch_size=16, progress=False, checkpoint_dir=str(tmp_path),
                  model_overrides={"embedding_dim": 4, "dnn": [8]})
    Trainer(TrainConfig(steps=6, **common)).train()
    with pytest.raises(ConfigError, match="--steps 4 is below the 6 steps already done"):
        Trainer(TrainConfig(steps=4, resume=True, **common))


def test_every_zoo_model_runs_on_its_bundled_sample(tmp_path):
    done = deeprec("train", "--model", "din", "--steps", "3", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "batch size 32" in done.stderr.replace("\n", " ") and "eval AUC" in done.stdout


def _serve_one(export_dir, rows, cwd):
    """Start `deeprec serve` on a free port, score `rows` ({column: [values]}), stop it."""
    proc = subprocess.Popen([sys.executable, "-m", "deeprec.cli", "serve", str(export_dir), "--port", "0"], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        return httpx.post(f"{line.split()[-1]}/v1/predict", json={"inputs": rows}, timeout=60).json()["scores"]
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow
def test_own_model_file_trains_exports_and_serves(tmp_path, sample):
    for flags in (["--smart-stage"], ["--micro-batch", "2"]):
        ck = tmp_path / f"ck{len(flags)}"
        done = deeprec("train", "--model", SPEC, "--data", sample, "--steps", "12", "--batch-size", "16",
                       "--checkpoint-dir", str(ck), *flags, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
    done = deeprec("export", "--checkpoint", str(tmp_path / "ck1"), "--out", str(tmp_path / "exp"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    scores = _serve_one(tmp_path / "exp", _json_rows(sample, resolve_schema([sample], None), 3), tmp_path)
    assert len(scores) == 3 and all(0.0 < s < 1.0 for s in scores)


@pytest.mark.slow
def test_own_model_trains_on_a_ps_job_and_its_checkpoint_evaluates_exports_and_serves(tmp_path, sample):
    ck = tmp_path / "ck"
    done = deeprec("launch", "--ps", "1", "--workers", "2", "--", "train", "--model", SPEC, "--data", sample,
                   "--steps", "10", "--batch-size", "16", "--checkpoint-dir", str(ck), cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[launch] job: 2 workers" in done.stdout
    evaluated = deeprec("evaluate", "--checkpoint", str(ck), "--data", sample, "--batch-size", "50", cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "parameter-server job" in evaluated.stderr.replace("\n", " ")
    metrics = json.loads(evaluated.stdout.strip().splitlines()[-1])
    exported = deeprec("export", "--checkpoint", str(ck), "--out", str(tmp_path / "exp"), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    # the export scores as the merged checkpoint does: its log loss over the sample equals evaluate's
    from deeprec.cli import model_from_checkpoint
    from deeprec.data import open_reader
    from deeprec.metrics import evaluate
    from deeprec.serving import load

    served = load(str(tmp_path / "exp"))
    model, _, schema, _ = model_from_checkpoint(str(ck))
    reader = open_reader([sample], 50, schema=schema)
    batch = next(iter(reader))
    with torch.no_grad():
        model.eval()
        expected = torch.sigmoid(model(batch)["logits"])
    assert torch.allclose(served(batch), expected, atol=1e-6)
    assert metrics["logloss"] == pytest.approx(evaluate(model, open_reader([sample], 50, schema=schema))["logloss"])
    scores = _serve_one(tmp_path / "exp", _json_rows(sample, schema, 2), tmp_path)
    assert torch.allclose(torch.tensor(scores), expected[:2], atol=1e-6)


@pytest.mark.slow
def test_sigterm_checkpoints_and_resume_continues_exactly(tmp_path, sample):
    common = ["train", "--model", "wdl", "--data", sample, "--batch-size", "16", "--lr", "0.01"]
    proc = subprocess.Popen([sys.executable, "-m", "deeprec.cli", *common, "--steps", "100000",
                             "--checkpoint-dir", str(tmp_path / "run")], cwd=tmp_path, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    lines = []
    for line in proc.stderr:  # not a terminal: a line every 100 steps
        lines.append(line)
        if line.startswith("step 100 "):
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.stderr.read()
    assert proc.wait(120) == 143, "".join(lines) + rest
    stopped = " ".join(rest.split())
    assert "stopped by SIGTERM after step" in stopped and "continue with --resume" in stopped
    step = int(stopped.split("after step ")[1].split(":")[0])
    assert step >= 100
    total = str(step + 15)
    resumed = deeprec(*common, "--steps", total, "--checkpoint-dir", str(tmp_path / "run"), "--resume", cwd=tmp_path)
    assert resumed.returncode == 0 and f"at step {step}" in resumed.stderr, resumed.stderr[-2000:]
    straight = deeprec(*common, "--steps", total, "--checkpoint-dir", str(tmp_path / "straight"), cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-2000:]
    from deeprec.checkpoint import latest_checkpoint, load_checkpoint

    a = load_checkpoint(latest_checkpoint(str(tmp_path / "run")))["model"]
    b = load_checkpoint(latest_checkpoint(str(tmp_path / "straight")))["model"]
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # exactly


def test_an_empty_held_out_shard_fails_before_training(tmp_path, sample):
    done = deeprec("data", "convert", sample, "--out", str(tmp_path / "s.parquet"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = deeprec("train", "--data", str(tmp_path / "s.parquet"), "--eval-fraction", "0.1", "--steps", "5",
                   cwd=tmp_path)
    said = " ".join(done.stderr.split())
    assert done.returncode == 2 and "--eval-fraction 0.1 holds out shard 10 of 10" in said
    assert "at most 1 shard(s)" in said and "use --eval-data" in said and "step" not in said.split("error:")[0]
