import json
import os
import subprocess
import sys

import pytest

from deeprec.cli import main
from deeprec.data import CriteoReader
from output import line_with


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


@pytest.mark.slow
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
    assert main(["explain", "--model", "dlrm", "--embedding", "table"]) == 0
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
    # the file's flat keys (the flags' names) land in their sections
    assert (cfg.model.name, cfg.data.paths, cfg.training.steps, cfg.optimizer.lr) == ("wdl", [sample], 9, 0.01)
    assert cfg.model.overrides == {"embedding_dim": 8, "dnn": [32, 16]}
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
    assert "--capacity (optimize.smart_stage_options.capacity in a config file): expected `int` >= 1" in \
        capsys.readouterr().err
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
    from deeprec.options import field_docs

    for section in dataclasses.fields(TrainConfig):  # every flag of every section has its help
        if section.name == "optimize":
            continue
        cls = section.default_factory().__class__
        missing = [f.name for f in dataclasses.fields(cls) if f.metadata.get("cli", True) is not False
                   and not (f.metadata.get("help") or field_docs(cls).get(f.name))]
        assert not missing, (section.name, missing)


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


def test_train_config_sections_from_toml_tables_flags_and_python(tmp_path, sample):
    """One declaration per option: a TOML table per section, the flags of before, and
    TrainConfig.create with sections or flat names all give the same config."""
    from deeprec.cli import build_parser, train_config
    from deeprec.errors import ConfigError
    from deeprec.trainer import TrainConfig
    from rich.console import Console

    run = tmp_path / "run.toml"
    run.write_text(f'[data]\npaths = ["{sample}"]\nbatch_size = 16\n[checkpoint]\ndir = "{tmp_path / "ck"}"\n'
                   'every = 5\n[storage]\ntiers = ["dram", "ssd"]\ndram_bytes = 4096\n[distributed]\nsync = true\n'
                   "[model.overrides]\nembedding_dim = 8\n")
    from_file, _, _ = train_config(build_parser().parse_args(["train", "--config", str(run)]), Console(stderr=True))
    from_flags, _, _ = train_config(build_parser().parse_args(
        ["train", "--data", sample, "--batch-size", "16", "--checkpoint-dir", str(tmp_path / "ck"),
         "--checkpoint-every", "5", "--storage", "ssd", "--dram-bytes", "4096", "--sync"]), Console(stderr=True))
    flat = TrainConfig.create(data=[sample], batch_size=16, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=5,
                              storage="ssd", dram_bytes=4096, sync=True, model_overrides={"embedding_dim": 8})
    nested = TrainConfig.create(data={"paths": [sample], "batch_size": 16},
                                checkpoint={"dir": str(tmp_path / "ck"), "every": 5},
                                storage={"tiers": ["dram", "ssd"], "dram_bytes": 4096}, distributed={"sync": True},
                                model={"overrides": {"embedding_dim": 8}})
    from_flags.model.overrides = {"embedding_dim": 8}  # no flag: a TOML table or Python only
    for cfg in (from_file, from_flags, flat):
        assert cfg == nested
    assert nested.storage.tiered and nested.checkpoint.dir == str(tmp_path / "ck")
    with pytest.raises(ConfigError, match="unknown option 'checkpoint_directory'.*checkpoint_dir"):
        TrainConfig.create(data=[sample], checkpoint_directory="x")
    with pytest.raises(ConfigError, match="unknown option 'data.path'"):
        TrainConfig.create(data={"path": [sample]})


def test_train_help_groups_flags_by_section_with_the_fields_docstrings():
    from deeprec.cli import build_parser

    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for section in ("data:", "model:", "optimizer:", "training:", "checkpoint:", "export:", "storage:",
                    "distributed:", "optimizations (deeprec.optimize):"):
        assert f"\n{section}\n" in text, section
    data_part = text.split("\ndata:\n")[1].split("\nmodel:\n")[0]
    assert "--eval-fraction" in data_part and "--checkpoint-dir" not in data_part
    assert "rows per training batch" in data_part  # the docstring under DataConfig.batch_size


@pytest.mark.parametrize("argv, names", [
    (["train", "--steps", "-5"], "--steps"),
    (["train", "--lr", "-1"], "--lr"),
    (["train", "--batch-size", "0"], "--batch-size"),
    (["train", "--eval-fraction", "1.5"], "--eval-fraction"),
    (["train", "--synthetic", "0"], "--synthetic"),
    (["train", "--storage", "ssd", "--dram-bytes", "2X"], "--dram-bytes"),
    (["train", "--storage", "ssd"], "--dram-bytes"),
    (["train", "--optimizer", "lamb"], "--optimizer"),
    (["launch", "--workers", "0", "--", "train"], "--workers"),
    (["evaluate", "--checkpoint", "x", "--data", "y", "--batch-size", "-1"], "--batch-size"),
])
def test_bad_flag_values_exit_2_with_one_line_naming_the_flag(argv, names, capsys):
    with pytest.raises(SystemExit) as stopped:
        code = main(argv)
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err
    assert names in err and "Traceback" not in err, err
    assert len([line for line in err.strip().splitlines() if "error" in line]) == 1, err


@pytest.mark.parametrize("toml, names", [
    ('steps = "five"\n', "--steps (training.steps in a config file): expected `int or none`, got 'five'"),
    ('[optimize]\nsmart_stage = "yes"\n', "--smart-stage (optimize.smart_stage in a config file): expected `bool`"),
    ('[training]\nseed = 1.5\n', "--seed"),
    ('[data]\nbatch_size = -3\n', "--batch-size"),
    ('[storage]\ntiers = ["dram", "ssd"]\ndram_bytes = "2G"\n[training]\nsteps = 0\n', "--steps"),
])
def test_bad_config_file_values_name_the_option(tmp_path, toml, names, capsys):
    run = tmp_path / "run.toml"
    run.write_text(toml)
    assert main(["train", "--config", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and line_with(err, names)


def test_sizes_take_units_everywhere_a_byte_count_is_asked(tmp_path, sample):
    from deeprec.trainer import TrainConfig

    cfg = TrainConfig.create(data=[sample], storage="ssd", dram_bytes="2G")
    assert cfg.storage.dram_bytes == 2 * 1024 ** 3
    assert TrainConfig.create(data=[sample], storage={"tiers": ["dram", "ssd"], "dram_bytes": "1.5GB"}
                              ).storage.dram_bytes == 1_500_000_000


def test_export_onto_an_existing_file_is_refused_with_one_line(tmp_path, capsys):
    ck = tmp_path / "ck"
    assert main(["train", "--model", "dlrm", "--steps", "2", "--no-progress", "--checkpoint-dir", str(ck)]) == 0
    target = tmp_path / "a_file"
    target.write_text("keep me")
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(ck), "--out", str(target)]) == 2
    assert "is a file: an export is a folder" in capsys.readouterr().err
    assert target.read_text() == "keep me"


def test_explain_takes_every_embedding_kind_train_takes(capsys):
    assert main(["explain", "--model", "dlrm", "--embedding", "torch"]) == 0


def test_data_convert_takes_any_schema_and_the_parquet_trains(tmp_path, capsys):
    import pyarrow.parquet as pq

    from deeprec.cli import sample_path
    from deeprec.data import CsvReader, schema_for

    out = tmp_path / "movielens.parquet"
    assert main(["data", "convert", sample_path("movielens_sample.txt"), "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["schema"] == "movielens"
    table = pq.read_table(out)
    source = sample_path("movielens_sample.txt")
    first = next(iter(CsvReader([source], schema_for(source), 200)))  # the columns a reader yields, as read
    assert table.num_rows == 200 and set(table.column_names) == set(first)
    label = schema_for(source).labels[0]
    assert table.column(label).to_pylist() == first[label].tolist()
    assert main(["train", "--model", "din", "--data", str(out), "--schema", "movielens", "--steps", "2",
                 "--batch-size", "16", "--no-progress"]) == 0
    assert main(["data", "convert", str(out), "--out", str(tmp_path / "again.parquet")]) == 2
    assert "Parquet files already" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_refuses_a_port_in_use_and_a_manifest_without_checksums_in_one_line(tmp_path, capsys):
    import socket

    ck, exported = tmp_path / "ck", tmp_path / "exported"
    assert main(["train", "--steps", "2", "--no-progress", "--checkpoint-dir", str(ck)]) == 0
    assert main(["export", "--checkpoint", str(ck), "--out", str(exported), "--no-compile"]) == 0
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    capsys.readouterr()
    try:
        assert main(["serve", str(exported), "--port", str(taken.getsockname()[1])]) == 2
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert "cannot listen there" in err and "--port" in err and "Traceback" not in err
    manifest = exported / "manifest.json"
    values = json.loads(manifest.read_text())
    del values["sha256"]
    manifest.write_text(json.dumps(values))
    assert main(["serve", str(exported), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "not a complete deeprec export manifest" in err and "Traceback" not in err
