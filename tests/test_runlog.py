"""--log-dir: TensorBoard event files read back with tensorboard's own reader."""
import os
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from deeprec.errors import ConfigError
from deeprec.trainer import TrainConfig, Trainer


def scalars(path: str) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def texts(path: str) -> dict[str, str]:
    events = EventAccumulator(path, size_guidance={"tensors": 0})
    events.Reload()
    return {tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in events.Tags()["tensors"]}


@pytest.mark.slow
def test_a_local_run_records_training_and_every_evaluation(tmp_path, behavior):
    train, held_out = behavior
    cfg = TrainConfig.create(model="din", data=[train], eval_data=[held_out], steps=40, batch_size=128,
                             eval_every=20, log_dir=str(tmp_path / "tb"), log_every=10, progress=False,
                             optimize={"smart_stage": True}, model_overrides={"hash_buckets": 20000})
    trainer = Trainer(cfg)
    result = trainer.train()
    found = scalars(str(tmp_path / "tb"))
    assert [step for step, _ in found["train/loss"]] == [10, 20, 30, 40]
    assert [step for step, _ in found["train/samples_per_s"]] == [10, 20, 30, 40]
    assert all(value > 0 for _, value in found["time/step_ms"] + found["time/stage_ms"])
    history = result["eval_history"]  # at 20 and 40: the final evaluation is the one at step 40
    assert found["eval/auc"] == [(h["step"], pytest.approx(h["auc"], rel=1e-6)) for h in history]
    assert found["eval/gauc"] == [(h["step"], pytest.approx(h["gauc"], rel=1e-6)) for h in history]
    assert [s for s, _ in found["eval/logloss"]] == [20, 40] and "eval/rows" not in found
    shown = texts(str(tmp_path / "tb"))
    assert "log_dir" in shown["config/text_summary"] and "SmartStage auto picked" in shown["smart_stage/text_summary"]


def test_multi_task_models_get_an_auc_per_task(tmp_path, behavior):
    train, held_out = behavior
    cfg = TrainConfig.create(model="mmoe", data=[train], eval_data=[held_out], steps=10, batch_size=128,
                             log_dir=str(tmp_path), log_every=5, progress=False, model_overrides={"hash_buckets": 20000})
    ev = Trainer(cfg).train()["eval"]
    found = scalars(str(tmp_path))
    for task in ("click", "like"):
        assert found[f"eval/{task}/auc"] == [(10, pytest.approx(ev["tasks"][task]["auc"], rel=1e-6))]
    assert [s for s, _ in found["train/loss"]] == [5, 10]
    assert not [tag for tag in found if tag.endswith("auc_error_bound")]  # a size, not plotted, per task too


def test_a_resumed_run_continues_its_curve(tmp_path, sample):
    common = dict(data=[sample], batch_size=64, log_dir=str(tmp_path / "tb"), log_every=5, progress=False,
                  checkpoint={"dir": str(tmp_path / "ck")})
    Trainer(TrainConfig.create(steps=10, **common)).train()
    Trainer(TrainConfig.create(steps=20, resume=True, **common)).train()
    assert [s for s, _ in scalars(str(tmp_path / "tb"))["train/loss"]] == [5, 10, 15, 20]


def test_a_failing_run_closes_its_log_with_the_curve_up_to_the_failure(tmp_path, sample, monkeypatch):
    cfg = TrainConfig.create(data=[sample], batch_size=64, steps=20, log_dir=str(tmp_path), log_every=5,
                             progress=False)
    trainer = Trainer(cfg)
    after_step = trainer._after_step

    def fail_at_7(progress):
        after_step(progress)
        if trainer.step == 7:
            raise RuntimeError("the data went away")

    monkeypatch.setattr(trainer, "_after_step", fail_at_7)
    with pytest.raises(RuntimeError, match="the data went away"):
        trainer.train()
    assert [s for s, _ in scalars(str(tmp_path))["train/loss"]] == [5]
    assert trainer.runlog.writer.all_writers is None  # closed: its queue written, its writer thread ended


def test_a_log_dir_that_cannot_be_made_is_named(tmp_path, sample):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="--log-dir .*file"):
        Trainer(TrainConfig.create(data=[sample], steps=2, log_dir=str(tmp_path / "file" / "tb"), progress=False))


def _job(tmp_path, *launch):
    env = dict(os.environ, DEEPREC_CACHE=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "deeprec.cli", "launch", *launch, "--", "train", "--synthetic", "4000",
                           "--cardinalities", "small", "--steps", "8", "--batch-size", "128", "--eval-batch-size", "512",
                           "--log-dir", str(tmp_path / "tb"), "--log-every", "4"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return sorted(os.listdir(tmp_path / "tb"))


@pytest.mark.slow
def test_a_collective_job_writes_a_run_per_rank_with_its_traffic(tmp_path):
    assert _job(tmp_path, "--workers", "2", "--collective") == ["rank-0", "rank-1"]
    for rank in ("rank-0", "rank-1"):
        found = scalars(str(tmp_path / "tb" / rank))
        assert [s for s, _ in found["train/loss"]] == [4, 8]
        assert all(v > 0 for _, v in found["collective/all_to_all_bytes"] + found["collective/all_reduce_bytes"])
        assert [s for s, _ in found["eval/auc"]] == [8]  # every rank evaluates (the job's whole eval data)


@pytest.mark.slow
def test_a_ps_job_writes_a_run_per_worker_with_its_rpc_traffic(tmp_path):
    assert _job(tmp_path, "--ps", "1", "--workers", "2") == ["worker-0", "worker-1"]
    for worker in ("worker-0", "worker-1"):
        found = scalars(str(tmp_path / "tb" / worker))
        assert [s for s, _ in found["train/loss"]] == [4, 8]
        assert all(v > 0 for _, v in found["ps/bytes_sent_per_step"] + found["ps/calls_per_step"])
    assert "eval/auc" in scalars(str(tmp_path / "tb" / "worker-0"))  # the chief evaluates
    assert "eval/auc" not in scalars(str(tmp_path / "tb" / "worker-1"))


def test_stage_ms_restarts_with_a_new_stats_object(tmp_path):
    # the training loop run again (after a PS recovery) brings a PrefetchStats counting from 0
    from deeprec.runlog import RunLog
    from deeprec.runtime.prefetch import PrefetchStats

    log = RunLog(str(tmp_path), None, every=1)
    first, second = PrefetchStats(prefetched=10, stage_seconds=1.0), PrefetchStats(prefetched=2, stage_seconds=0.004)
    log.step(1, 0.5, 8, first)
    first.prefetched, first.stage_seconds = 20, 1.5
    log.step(2, 0.5, 8, first)
    log.step(3, 0.5, 8, second)
    log.close()
    assert [round(v, 6) for _, v in scalars(str(tmp_path))["time/stage_ms"]] == [100.0, 50.0, 2.0]
