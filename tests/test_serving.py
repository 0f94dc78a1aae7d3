"""Serving exports: the exported program scores exactly as the trained model evaluates."""
import json
import os
import subprocess
import sys

import httpx
import pytest
import torch

import deeprec as dr
from deeprec.cli import sample_path
from deeprec.data import open_reader
from deeprec.data.collate import collate
from deeprec.errors import ConfigError
from deeprec.serving import RequestError, ServingError
from deeprec.serving.allocator import mimalloc_library, run_with
from deeprec.trainer import TrainConfig, Trainer

SAMPLES = {"din": "movielens_sample.txt", "mmoe": "byterec_sample.txt"}


def _trained(model, embedding, tmp_path):
    data = sample_path(SAMPLES.get(model, "criteo_sample.txt"))
    cfg = TrainConfig.create(model=model, data=[data], steps=3, batch_size=64, embedding=embedding, progress=False,
                             checkpoint_dir=str(tmp_path / "ckpt"))
    trainer = Trainer(cfg)
    trainer.train()
    return trainer, data


@pytest.mark.slow
@pytest.mark.parametrize("embedding", ["table", "variable"])
@pytest.mark.parametrize("model", ["dlrm", "deepfm", "wdl", "din", "mmoe"])
def test_export_scores_exactly_as_evaluation(tmp_path, model, embedding):
    trainer, data = _trained(model, embedding, tmp_path)
    path = dr.export(trainer.model, str(tmp_path / "export"), schema=trainer.schema, model_name=model,
                     step=trainer.step, compile=False)  # the traced program; the compiled one: test_serving_compiled
    served = dr.serving.load(path)
    assert served.step == 3 and served.manifest["model"] == model
    # every size symbolic from 0: 1 row is scored as it is (the models whose trace still assumes a size
    # above 1, or that torch.export cannot load back, are padded to 2 rows: DeepFM, WDL, DIN over tables
    # today); DLRM, the one the serving bench measures, must stay so
    assert served.any_size or model != "dlrm"
    trainer.model.eval()
    for size in (50, 7, 2, 1):  # any batch size, one row included
        batch = next(iter(open_reader([data], size, schema=trainer.schema)))
        # a padded 1-row request is scored as the row twice: compare on that batch
        same = collate([batch, batch]) if size == 1 and not served.any_size else batch
        with torch.no_grad():
            want = trainer.model(same)["logits"][:size]
        assert torch.equal(served.logits(batch), want), size  # exact on CPU fp32
        assert torch.equal(served(batch), torch.sigmoid(want))


def _dlrm_export(folder, rows: int = 16) -> tuple[str, list]:
    """A DLRM with EmbeddingVariables trained 3 steps on the Criteo sample, exported into `folder`; and
    `rows` of the sample's rows as JSON values."""
    data = sample_path("criteo_sample.txt")
    trainer = Trainer(TrainConfig.create(model="dlrm", data=[data], steps=3, batch_size=64, embedding="variable",
                                         progress=False))
    trainer.train()
    path = dr.export(trainer.model, str(folder / "dlrm"), schema=trainer.schema, model_name="dlrm", step=3)
    return path, _json_rows(data, trainer.schema, rows)


def _din_export(folder) -> str:
    """A DIN (int ids, sequences of int ids) trained 3 steps on synthetic behaviour data, exported into `folder`
    as its traced program (the tests of request handling; DIN's package: test_serving_compiled)."""
    from deeprec.data.synth_behavior import write_behavior

    data = str(folder / "behavior.tsv")
    write_behavior(data, 400, users=50, items=200, categories=10, max_length=8, progress=False)
    trainer = Trainer(TrainConfig.create(model="din", data=[data], steps=3, batch_size=64, progress=False))
    trainer.train()
    return dr.export(trainer.model, str(folder / "din"), schema=trainer.schema, model_name="din", step=3,
                     compile=False)


def _json_rows(path, schema, n):
    import csv

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))[:n]
    out = {}
    for c in schema.columns:
        if c.kind in ("label", "ignore"):
            continue
        values = [r[c.name] for r in rows]
        if c.kind == "dense":
            values = [float(v) if v else None for v in values]
        out[c.name] = values
    return out


@pytest.fixture(scope="module")
def dlrm_export(tmp_path_factory):
    """A DLRM with EmbeddingVariables trained 3 steps, and its export (shared: training and export take seconds)."""
    tmp = tmp_path_factory.mktemp("dlrm")
    trainer, data = _trained("dlrm", "variable", tmp)
    return trainer, data, dr.export(trainer.model, str(tmp / "e"), schema=trainer.schema, step=3)


@pytest.mark.slow
def test_json_rows_score_as_the_reader_batch(dlrm_export):
    trainer, data, path = dlrm_export
    served = dr.serving.load(path)
    rows = _json_rows(data, trainer.schema, 9)
    batch = next(iter(open_reader([data], 9, schema=trainer.schema)))
    assert torch.equal(served(json.loads(json.dumps(rows))), served(batch))
    one = next(iter(open_reader([data], 1, schema=trainer.schema)))  # rows counted from a Ragged or a tensor
    assert served(one).shape[0] == 1 and torch.equal(served(one), served(batch)[:1])


def test_bad_requests_name_the_field(dlrm_export):
    trainer, data, path = dlrm_export
    served = dr.serving.load(path)
    rows = _json_rows(data, trainer.schema, 2)
    absent = served({k: v for k, v in rows.items() if k != "C3"})  # an absent column is missing, as "" is
    assert torch.equal(absent, served({**rows, "C3": ["", ""]}))
    with pytest.raises(RequestError, match="field 'I1': 1 values, other fields have 2"):
        served({**rows, "I1": [1.0]})
    with pytest.raises(RequestError, match="field 'I2'"):
        served({**rows, "I2": ["x", "y"]})
    with pytest.raises(RequestError, match="field 'nope' is not a column"):
        served({**rows, "nope": [1, 2]})
    with pytest.raises(RequestError, match="empty batch: no column holds rows"):
        served({})


def test_a_corrupt_export_is_refused_naming_the_file(dlrm_export, tmp_path):
    import shutil

    path = str(tmp_path / "copy")
    shutil.copytree(dlrm_export[2], path)
    with open(f"{path}/tables.safetensors", "r+b") as f:
        f.seek(200)
        f.write(b"\x00" * 64)
    with pytest.raises(ServingError, match="tables.safetensors: missing or corrupt"):
        dr.serving.load(path)


@pytest.mark.slow
def test_cli_export_of_a_checkpoint_scores_as_the_trained_model(tmp_path):
    from deeprec.cli import main

    trainer, data = _trained("deepfm", "variable", tmp_path)
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "cli"), "--no-compile"]) == 0
    served = dr.serving.load(str(tmp_path / "cli"))
    assert served.manifest["model"] == "deepfm" and served.step == 3
    batch = next(iter(open_reader([data], 33, schema=trainer.schema)))
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(served.logits(batch), trainer.model(batch)["logits"])


def _online_cfg(tmp_path, steps, **kw):
    return TrainConfig.create(model="dlrm", data=[sample_path("criteo_sample.txt")], steps=steps, batch_size=16,
                              embedding="variable", progress=False, seed=2, export_compile=False, **kw)


@pytest.mark.slow
def test_deltas_bring_the_served_model_to_the_trained_one(tmp_path):
    exports = tmp_path / "exports"
    trainer = Trainer(_online_cfg(tmp_path, 11, export_dir=str(exports), export_every=5, export_incremental_every=2))
    trainer.train()
    names = sorted(p.name for p in exports.iterdir())
    assert names == ["delta-000000006.json", "delta-000000006.safetensors", "delta-000000008.json",
                     "delta-000000008.safetensors", "delta-000000011.json", "delta-000000011.safetensors",
                     "full-000000005", "full-000000010"]  # 2 full exports kept; deltas after the older one
    batch = next(iter(open_reader([sample_path("criteo_sample.txt")], 64, schema=trainer.schema)))
    for step in (8, 11):  # after the deltas up to step s, the model served is the training model at step s
        served = dr.serving.load(str(exports), upto_step=step)
        assert served.step == step
        reference = Trainer(_online_cfg(tmp_path, step)) if step < 11 else trainer
        if step < 11:
            reference.train()
        reference.model.eval()
        with torch.no_grad():
            assert torch.equal(served.logits(batch), reference.model(batch)["logits"]), step


@pytest.mark.slow(reason="a server start and its re-execution with mimalloc preloaded")
@pytest.mark.skipif(mimalloc_library() is None or not sys.platform.startswith("linux"),
                    reason="cmeel-mimalloc is not installed")
def test_serve_runs_with_mimalloc_and_answers_the_same_scores(dlrm_export, tmp_path):
    """`deeprec serve --allocator auto` (the default; the suite's own servers keep the system's)."""
    trainer, data, path = dlrm_export
    rows = _json_rows(data, trainer.schema, 8)
    env = {k: v for k, v in os.environ.items() if k != "DEEPREC_SERVE_ALLOCATOR"}
    log = open(tmp_path / "serve.log", "w+")  # a file: a pipe nobody reads could fill and block the server
    proc = subprocess.Popen([sys.executable, "-m", "deeprec", "serve", path, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), (line, log.seek(0) or log.read())
        with open(f"/proc/{proc.pid}/maps") as f:  # re-executed in place (the same pid), mimalloc mapped
            assert "libmimalloc" in f.read()
        reply = httpx.post(f"{line.split()[-1]}/v1/predict", json={"inputs": rows}, timeout=30)
        assert reply.status_code == 200, reply.text
        want = dr.serving.load(path)(rows)
        assert torch.equal(torch.tensor(reply.json()["scores"], dtype=torch.float32), want)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    assert proc.returncode == -15


def test_allocator_choices():
    with pytest.raises(ConfigError, match="--allocator 'tcmalloc': one of auto, mimalloc, system"):
        run_with("tcmalloc", ["serve", "x"])
    run_with("system", ["serve", "x"])  # nothing to do: returns
