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
from output import line_with

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
    cfg = TrainConfig.create(data=[sample], steps=3, batch_size=16, progress=False, eval_fraction=0.2)
    result = Trainer(cfg, model=ClickModel(resolve_schema([sample], None), dim=4)).train()
    assert result["steps"] == 3 and 0.0 <= result["eval"]["auc"] <= 1.0

    class NoLogits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, batch):
            return {"loss": (self.w * batch["I1"].nan_to_num()).sum()}

    with pytest.raises(ConfigError, match="must return a dict with 'loss'.*and 'logits'"):
        Trainer(TrainConfig.create(data=[sample], steps=2, batch_size=16, progress=False), model=NoLogits()).train()


def test_resume_below_done_steps_is_refused_before_training(tmp_path, sample):
    from deeprec.trainer import TrainConfig, Trainer

    common = dict(model="wdl", data=[sample], batch_size=16, progress=False, checkpoint_dir=str(tmp_path),
                  model_overrides={"embedding_dim": 4, "dnn": [8]})
    Trainer(TrainConfig.create(steps=6, **common)).train()
    with pytest.raises(ConfigError, match="--steps 4 is below the 6 steps already done"):
        Trainer(TrainConfig.create(steps=4, resume=True, **common))


@pytest.mark.slow
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
    # the traced program (the own model's compiled one: test_own_model_file_trains_exports_and_serves)
    exported = deeprec("export", "--checkpoint", str(ck), "--out", str(tmp_path / "exp"), "--no-compile", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    # the export scores as the merged checkpoint does: its log loss over the sample equals evaluate's
    from deeprec.strategies import model_from_checkpoint
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
    stopped = line_with(rest, "stopped by SIGTERM after step", "continue with --resume")
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


@pytest.mark.slow
def test_an_empty_held_out_shard_fails_before_training(tmp_path, sample):
    done = deeprec("data", "convert", sample, "--out", str(tmp_path / "s.parquet"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = deeprec("train", "--data", str(tmp_path / "s.parquet"), "--eval-fraction", "0.1", "--steps", "5",
                   cwd=tmp_path)
    said = done.stderr
    assert done.returncode == 2 and line_with(said, "--eval-fraction 0.1 holds out shard 10 of 10", "at most 1 shard(s)",
                                              "use --eval-data")
    assert "step" not in said.split("error:")[0]


def _scores(model, batch):
    with torch.no_grad():
        model.eval()
        return torch.sigmoid(model(batch)["logits"])


@pytest.mark.slow
def test_own_model_with_tiered_storage_serves_its_exports_and_deltas_while_training(tmp_path, sample):
    from deeprec.strategies import model_from_checkpoint
    from deeprec.data import open_reader
    from deeprec.serving.online import ExportFolder
    from deeprec.trainer import TrainConfig, Trainer

    cfg = TrainConfig.create(model=SPEC, data=[sample], steps=9, batch_size=16, progress=False, storage="ssd",
                      dram_bytes=26 * 20_000, storage_path=str(tmp_path / "disk"), checkpoint_dir=str(tmp_path / "ck"),
                      export_dir=str(tmp_path / "live"), export_every=6, export_incremental_every=3,
                      export_compile=False)
    result = Trainer(cfg).train()
    assert result["tiers"]["variables"] == 26 and result["tiers"]["disk_rows"] > 0  # the budget pushed rows to disk
    names = sorted(os.listdir(tmp_path / "live"))
    assert "full-000000006" in names and "delta-000000009.json" in names  # a full export, then a delta
    served = ExportFolder(str(tmp_path / "live")).load()
    model, state, schema, _ = model_from_checkpoint(str(tmp_path / "ck"))
    assert served.step == int(state["step"]) == 9
    batch = next(iter(open_reader([sample], 40, schema=schema)))
    assert torch.allclose(served(batch), _scores(model, batch), atol=1e-6)


@pytest.mark.slow
def test_own_model_on_a_ps_job_exports_while_training(tmp_path, sample):
    from deeprec.strategies import model_from_checkpoint
    from deeprec.data import open_reader
    from deeprec.serving.online import ExportFolder

    done = deeprec("launch", "--ps", "1", "--workers", "1", "--", "train", "--model", SPEC, "--data", sample,
                   "--steps", "9", "--batch-size", "16", "--checkpoint-dir", str(tmp_path / "ck"),
                   "--export-dir", str(tmp_path / "live"), "--export-every", "6", "--export-incremental-every", "3",
                   "--no-export-compile", cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    names = sorted(os.listdir(tmp_path / "live"))
    assert "full-000000006" in names and "delta-000000009.json" in names
    delta = json.loads((tmp_path / "live" / "delta-000000009.json").read_text())
    assert 0 < delta["rows"]  # the rows the PS updated in steps 7-9, pulled by the chief
    served = ExportFolder(str(tmp_path / "live")).load()
    model, state, schema, _ = model_from_checkpoint(str(tmp_path / "ck"))
    batch = next(iter(open_reader([sample], 40, schema=schema)))
    assert served.step == 9 and torch.allclose(served(batch), _scores(model, batch), atol=1e-6)


@pytest.mark.slow
def test_own_model_trains_collectively(tmp_path, sample):
    spec = os.path.join(ROOT, "tests", "custom_models.py") + ":CollectionModel"  # fixed tables, sharded by the plan
    done = deeprec("launch", "--workers", "2", "--collective", "--", "train", "--model", spec, "--data", sample,
                   "--eval-data", sample, "--steps", "6", "--batch-size", "16", "--checkpoint-dir",
                   str(tmp_path / "ck"), cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[launch] job: 2 workers, 6 steps" in done.stdout and "eval AUC" in done.stdout
    evaluated = deeprec("evaluate", "--checkpoint", str(tmp_path / "ck"), "--data", sample, cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    auc = json.loads(evaluated.stdout.strip().splitlines()[-1])["auc"]
    assert f"eval AUC {auc:.4f}" in done.stdout  # the merged checkpoint scores as the ranks did


@pytest.mark.slow
def test_a_shared_embedding_variable_trains_on_a_ps_as_locally(ps_pool, sample):
    """One EV called for two columns: each call's gradient goes to its own keys on the PS too."""
    from deeprec.distributed.ps.strategy import ParameterServer
    from deeprec.distributed.ps.worker import ps_variables
    from deeprec.trainer import TrainConfig, Trainer

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from custom_models import SharedEmbedding

    common = dict(data=[sample], steps=5, batch_size=32, optimizer="sgd", lr=0.1, progress=False)
    torch.manual_seed(0)
    local = Trainer(TrainConfig.create(**common), model=SharedEmbedding())
    torch.manual_seed(0)
    remote_model = SharedEmbedding()
    reference = ps_variables(remote_model)["ids"]
    addresses, _ = ps_pool(1)
    remote = Trainer(TrainConfig.create(**common), model=remote_model, strategy=ParameterServer(addresses))
    local.train()
    remote.train()
    rows = remote.updater.client.snapshot()
    keys, values = rows["emb/ids/keys"], rows["emb/ids/values"]
    want_keys, want_values = local.model.ids.snapshot()
    order, want_order = torch.argsort(keys), torch.argsort(want_keys)
    assert reference is not None and torch.equal(keys[order], want_keys[want_order])
    torch.testing.assert_close(values[order], want_values[want_order], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_ctrl_c_at_the_terminal_stops_a_ps_job_with_a_checkpoint(tmp_path, sample):
    train = ["train", "--model", "wdl", "--data", sample, "--batch-size", "16", "--checkpoint-dir", str(tmp_path / "ck")]
    proc = subprocess.Popen([sys.executable, "-m", "deeprec.cli", "launch", "--ps", "1", "--workers", "2", "--", *train,
                             "--steps", "100000"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    for line in proc.stdout:
        if "] step 100 " in line:
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the launcher's whole group
            break
    rest = proc.stdout.read()
    assert proc.wait(180) == 130, rest[-3000:]
    assert "job stopped on SIGINT" in rest and "continue it with --resume" in rest
    stopped = line_with(rest, "[worker0] stopped by SIGINT after step ")
    step = int(stopped.split("[worker0] stopped by SIGINT after step ")[1].split(":")[0])
    resumed = deeprec("launch", "--ps", "1", "--workers", "2", "--resume", "--", *train, "--steps", str(step + 5),
                      cwd=tmp_path, timeout=600)
    assert resumed.returncode == 0 and f"at step {step}" in resumed.stdout, resumed.stdout[-3000:]
