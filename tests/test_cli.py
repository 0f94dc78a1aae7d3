import json
import os
import subprocess
import sys

import pytest

from deeprec.cli import main
from deeprec.data import CriteoReader


@pytest.mark.parametrize("model", ["dlrm", "deepfm", "wdl"])
def test_train_each_model_on_real_sample(model, sample, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["train", "--model", model, "--data", sample, "--steps", "20", "--batch-size", "32",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # 200 rows = 6 batches of 32 + one of 8 per epoch, repeated: 200 + 200 + 6 * 32
    assert result["steps"] == 20 and result["rows"] == 592
    assert "samples/s" in capsys.readouterr().out


def test_default_run_is_the_bundled_smoke_run(capsys, tmp_path):
    out = tmp_path / "r.json"
    assert main(["train", "--epochs", "1", "--batch-size", "32", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert "200-row real Criteo sample" in captured.err and "eval AUC" in captured.out
    result = json.loads(out.read_text())
    assert 0 < result["eval"]["rows"] < 200 and result["rows"] + result["eval"]["rows"] == 200


def test_malformed_file_reports_line(tmp_path, sample_rows, capsys):
    lines = ["\t".join(r) for r in sample_rows[:20]]
    lines[13] = "\t".join(sample_rows[13][:20])
    path = tmp_path / "broken.tsv"
    path.write_text("\n".join(lines) + "\n")
    assert main(["train", "--data", str(path), "--steps", "2"]) == 1  # a data error
    assert f"{path}:14: expected 40 fields, found 20" in capsys.readouterr().err.replace("\n", "")
    assert main(["train", "--data", str(path), "--steps", "2", "--batch-size", "8", "--on-bad-row", "skip"]) == 0


def test_synth_convert_train_resume_evaluate(tmp_path, capsys):
    tsv, pq = tmp_path / "s.tsv", tmp_path / "s.parquet"
    assert main(["data", "synth", "--rows", "3000", "--out", str(tsv), "--cardinalities", "small", "--seed", "3"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rows"] == 3000 and 0.1 < summary["click_rate"] < 0.5
    assert sum(len(b["label"]) for b in CriteoReader(str(tsv), 1000)) == 3000
    assert main(["data", "convert", str(tsv), "--out", str(pq)]) == 0
    capsys.readouterr()
    ckpt = tmp_path / "ckpt"
    args = ["train", "--data", str(pq), "--batch-size", "256", "--checkpoint-dir", str(ckpt)]
    assert main(args + ["--steps", "5"]) == 0
    assert main(args + ["--steps", "8", "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().err
    assert main(["evaluate", "--checkpoint", str(ckpt), "--data", str(tsv)]) == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["rows"] == 3000 and 0.0 <= metrics["auc"] <= 1.0


def test_synthetic_flag_caches_files(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPREC_CACHE", str(tmp_path))
    assert main(["train", "--synthetic", "2000", "--cardinalities", "small", "--steps", "3"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["synth-small-1000-seed1000003-eval.tsv", "synth-small-2000-seed0-train.tsv"]


def test_console_script_is_installed():
    exe = os.path.join(os.path.dirname(sys.executable), "deeprec")
    done = subprocess.run([exe, "train", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--checkpoint-dir" in done.stdout
    bad = subprocess.run([exe, "train", "--model", "xyz"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "'xyz' is neither a zoo model" in bad.stderr.replace("\n", " ")


def test_train_with_smart_stage_and_explain(sample, tmp_path, capsys):
    out_plain, out_staged = tmp_path / "a.json", tmp_path / "b.json"
    base = ["train", "--model", "wdl", "--data", sample, "--steps", "12", "--batch-size", "16"]
    assert main(base + ["--json", str(out_plain)]) == 0
    assert main(base + ["--smart-stage", "--stage-executor", "thread", "--capacity", "3", "--stage-threads", "2",
                        "--json", str(out_staged)]) == 0
    plain, staged = json.loads(out_plain.read_text()), json.loads(out_staged.read_text())
    assert staged["stage"]["taken"] == 12
    # the step may run on fewer intra-op threads while staging: equal up to float rounding
    assert staged["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-5)
    auto = tmp_path / "auto.json"  # --smart-stage alone: executor auto, and the run says what it picked
    assert main(base[:-4] + ["--steps", "30", "--batch-size", "16", "--smart-stage", "--json", str(auto)]) == 0
    picked = json.loads(auto.read_text())
    assert picked["auto_executor"] in ("off", "thread", "process") and "SmartStage auto picked" in picked["auto"]
    capsys.readouterr()
    assert main(["explain", "--model", "dlrm"]) == 0
    text = capsys.readouterr().out
    assert "string_to_hash_bucket, " in text and "data-side nodes kept in main" in text  # one op, 26 columns


@pytest.mark.parametrize("embedding", ["variable", "torch"])
def test_train_with_each_embedding_kind(embedding, tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("DEEPREC_CACHE", str(tmp_path))
    out = tmp_path / "r.json"
    try:
        assert main(["train", "--synthetic", "3000", "--synthetic-cardinalities", "kaggle", "--steps", "6",
                     "--embedding", embedding, "--json", str(out)]) == 0
        assert (torch.tensor([1e-39]) * 1.0).item() == 0.0  # the trainer switched denormal flushing on
    finally:
        torch.set_flush_denormal(False)
    assert json.loads(out.read_text())["steps"] == 6


def test_train_exposes_graph_options(sample, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["train", "--model", "deepfm", "--data", sample, "--steps", "4", "--batch-size", "32",
                 "--multi-stream", "2", "--stream-policy", "full", "--micro-batch", "2", "--bf16",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["steps"] == 4 and result["rows"] == 128
    with pytest.raises(SystemExit):
        main(["train", "--stream-policy", "fastest"])
    assert "invalid choice: 'fastest'" in capsys.readouterr().err


def test_config_file_sets_options_and_flags_override_it(tmp_path, monkeypatch, sample):
    from deeprec.cli import build_parser, train_config
    from rich.console import Console

    run = tmp_path / "run.toml"
    run.write_text(f'model = "wdl"\ndata = ["{sample}"]\nsteps = 7\nlr = 0.01\n'
                   "[model_overrides]\nembedding_dim = 8\ndnn = [32, 16]\n"
                   "[optimize]\nsmart_stage = true\nmicro_batch_num = 2\n"
                   '[optimize.smart_stage_options]\ncapacity = 3\nexecutor = "thread"\n')
    args = build_parser().parse_args(["train", "--config", str(run), "--steps", "9", "--stage-threads", "2"])
    cfg, _, _ = train_config(args, Console(stderr=True))
    assert (cfg.model, cfg.data, cfg.steps, cfg.lr) == ("wdl", [sample], 9, 0.01)  # --steps beat the file's 7
    assert cfg.model_overrides == {"embedding_dim": 8, "dnn": [32, 16]}
    opts = cfg.optimize.smart_stage_options
    assert cfg.optimize.smart_stage and cfg.optimize.micro_batch_num == 2
    assert (opts.capacity, opts.num_threads, opts.executor) == (3, 2, "thread")
    # without the file: the trainer's defaults (SmartStage executor auto), and the nested flags
    args = build_parser().parse_args(["train", "--data", sample, "--multi-stream", "2", "--bf16", "auto"])
    cfg, _, _ = train_config(args, Console(stderr=True))
    assert cfg.optimize.smart_stage_options.executor == "auto" and cfg.optimize.bf16 == "auto"
    assert (cfg.optimize.multi_stream.num_streams, cfg.optimize.multi_stream.policy) == (2, "embedding")
    out = tmp_path / "wdl.json"
    assert main(["train", "--config", str(run), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["steps"] == 7


def test_config_file_errors_name_the_file_and_the_allowed_keys(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("stepz = 3\n")
    assert main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.toml" in err and "unknown option 'stepz'" in err and "steps" in err
    bad.write_text("[optimize.smart_stage_options]\ncapacity = 0\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "capacity must be a positive int" in capsys.readouterr().err
    bad.write_text("[optimize]\nstage_thread_pools = []\n")  # not settable from a file
    assert main(["train", "--config", str(bad)]) == 2
    assert "unknown option 'optimize.stage_thread_pools'" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2


def test_version_and_help_show_every_option_with_its_default(capsys):
    import dataclasses

    import deeprec
    from deeprec.cli import build_parser
    from deeprec.trainer import TrainConfig

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"deeprec {deeprec.__version__}"
    text = " ".join(build_parser()._subparsers._group_actions[0].choices["train"].format_help().split())
    for flag in ("--steps", "--capacity", "--stage-threads", "--stage-executor", "--micro-batch", "--compile",
                 "--bf16", "--multi-stream", "--stream-policy", "--async-embedding", "--config"):
        assert flag in text, flag
    assert "(default: 512)" in text and "(default: auto)" in text  # batch size; the trainer's stage executor
    cli_fields = [f for f in dataclasses.fields(TrainConfig) if f.metadata.get("cli", True) is not False]
    helps = [f.metadata.get("help") for f in cli_fields if f.name != "optimize"]
    assert all(helps), [f.name for f in cli_fields if not f.metadata.get("help")]


def test_tf_config_becomes_a_worker_task_in_one_place(tmp_path, monkeypatch):
    from deeprec.distributed import worker_task_from_env
    from deeprec.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert worker_task_from_env() is None
    (tmp_path / ".endpoint_map").write_text("ps-1:2222 10.0.0.7:3333\n")
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"ps": ["ps-0:2222", "ps-1:2222"],
                                                            "worker": ["w-0:1", "w-1:1", "w-2:1"]},
                                                "task": {"type": "worker", "index": 2}}))
    task = worker_task_from_env()
    assert task.ps_addresses == ["ps-0:2222", "10.0.0.7:3333"] and (task.index, task.num_workers) == (2, 3)
    assert not task.is_chief
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"ps": ["ps-0:2222"]}, "task": {"type": "ps"}}))
    with pytest.raises(ConfigError, match="runs worker tasks"):
        worker_task_from_env()
