import os

import pytest
import torch

from deeprec.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from deeprec.errors import ConfigError
from deeprec.metrics import evaluate
from deeprec.trainer import TrainConfig, Trainer


def _cfg(data, ckpt, small_model, **kw):
    base = dict(model="dlrm", data=[data], batch_size=256, shuffle_buffer=1000, seed=4,
                checkpoint_dir=str(ckpt), model_overrides=small_model, progress=False)
    base.update(kw)
    return TrainConfig.create(**base)


def _assert_same_state(a: Trainer, b: Trainer):
    for (name, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        assert torch.equal(p, q) if isinstance(p, torch.Tensor) else p == q, name
    sa, sb = a.updater.optimizer.state_dict(), b.updater.optimizer.state_dict()
    for oa, ob in zip(sa["optimizers"], sb["optimizers"], strict=True):
        for key in oa["state"]:
            for field, value in oa["state"][key].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(ob["state"][key][field])), (key, field)


@pytest.mark.parametrize("optimizer,embedding", [("adam", "table"), ("adagrad", "table"),
                                                 ("adam", "variable"), ("sgd", "torch")])
def test_resume_equals_uninterrupted_run(tmp_path, unique_tsv, small_model, optimizer, embedding):
    # 10,000 rows / 256 = 40 batches per epoch: 55 steps cross an epoch boundary.
    kw = dict(optimizer=optimizer, embedding=embedding)
    full = Trainer(_cfg(unique_tsv, tmp_path / "full", small_model, steps=55, **kw))
    full.train()
    first = Trainer(_cfg(unique_tsv, tmp_path / "split", small_model, steps=23, **kw))
    first.train()
    resumed = Trainer(_cfg(unique_tsv, tmp_path / "split", small_model, steps=55, resume=True, **kw))
    assert resumed.step == 23
    result = resumed.train()
    assert result["steps"] == 55 and result["steps_this_run"] == 32
    _assert_same_state(full, resumed)


def test_resume_with_epochs_and_periodic_checkpoints(tmp_path, unique_tsv, small_model):
    full = Trainer(_cfg(unique_tsv, tmp_path / "a", small_model, epochs=2))
    assert full.train()["steps"] == 80
    part = Trainer(_cfg(unique_tsv, tmp_path / "b", small_model, epochs=2, checkpoint_every=30))
    # simulate a crash after step 60: stop the loop by exhausting it early
    part.cfg.training.steps, part.cfg.training.epochs = 60, None
    part.train()
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path / "b"))] == [
        "checkpoint-000000030.pt", "checkpoint-000000060.pt"]
    resumed = Trainer(_cfg(unique_tsv, tmp_path / "b", small_model, epochs=2, resume=True))
    assert resumed.step == 60 and resumed.train()["steps"] == 80
    _assert_same_state(full, resumed)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    save_checkpoint(str(tmp_path), 1, {"x": torch.ones(3)})

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(str(tmp_path), 2, {"x": torch.zeros(3)})
    # no partial or temp file left
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-000000001.manifest.json", "checkpoint-000000001.pt"]
    assert torch.equal(load_checkpoint(latest_checkpoint(str(tmp_path)))["x"], torch.ones(3))


def test_old_checkpoints_pruned(tmp_path):
    for step in range(1, 6):
        save_checkpoint(str(tmp_path), step, {"step": step}, keep=2)
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == [
        "checkpoint-000000004.pt", "checkpoint-000000005.pt"]


def test_resume_refuses_other_model(tmp_path, unique_tsv, small_model):
    Trainer(_cfg(unique_tsv, tmp_path, small_model, steps=2)).train()
    with pytest.raises(ConfigError, match="holds a 'dlrm' model, not 'wdl'"):
        Trainer(_cfg(unique_tsv, tmp_path, {}, model="wdl", steps=4, resume=True))


def test_config_errors(unique_tsv):
    with pytest.raises(ConfigError, match="--steps or --epochs, not both"):
        TrainConfig.create(data=[unique_tsv], steps=1, epochs=1)
    with pytest.raises(ConfigError, match="--resume needs --checkpoint-dir"):
        TrainConfig.create(data=[unique_tsv], resume=True)
    with pytest.raises(ConfigError, match="--optimizer .*'lamb' is not allowed; choose one of adagrad, adam, sgd"):
        Trainer(TrainConfig.create(data=[unique_tsv], optimizer="lamb", progress=False))


def test_evaluate_uses_model_predictions(sample):
    from sklearn.metrics import log_loss, roc_auc_score

    from deeprec.data import CriteoReader

    class Oracle(torch.nn.Module):  # logits = label: perfect ranking
        def forward(self, batch):
            return {"logits": batch["label"] * 4 - 2}

    metrics = evaluate(Oracle(), CriteoReader(sample, 64))
    assert metrics["rows"] == 200 and metrics["auc"] == 1.0
    labels = torch.cat([b["label"] for b in CriteoReader(sample, 64)])

    class Noisy(torch.nn.Module):
        def forward(self, batch):
            return {"logits": batch["I2"].nan_to_num(0.0)}

    got = evaluate(Noisy(), CriteoReader(sample, 64))
    i2 = torch.cat([b["I2"].nan_to_num(0.0) for b in CriteoReader(sample, 64)])
    p = torch.sigmoid(i2.double()).numpy()
    # bucketed AUC: within its stated bound of the exact one (ties at p == 1 make the bound > 0 here)
    assert abs(got["auc"] - roc_auc_score(labels.numpy(), p)) <= got["auc_error_bound"] + 1e-12
    assert got["logloss"] == pytest.approx(log_loss(labels.numpy(), p), rel=1e-12)


def test_smart_stage_trains_to_the_same_state(tmp_path, unique_tsv, small_model):
    threads = torch.get_num_threads()
    plain = Trainer(_cfg(unique_tsv, tmp_path / "plain", small_model, steps=30))
    staged = Trainer(_cfg(unique_tsv, tmp_path / "staged", small_model, steps=30, optimize=dict(
        smart_stage=True, main_threads=threads, smart_stage_options=dict(capacity=4, num_threads=2, executor="thread"))))
    a, b = plain.train(), staged.train()
    assert a["final_loss"] == b["final_loss"] and b["stage"]["taken"] == 30 and b["stage"]["dropped"] == 0
    _assert_same_state(plain, staged)


def test_smart_stage_checkpoint_holds_the_consumed_position(tmp_path, unique_tsv, small_model):
    # the stage reads ahead of the step; the checkpoint must record what was trained on
    full = Trainer(_cfg(unique_tsv, tmp_path / "full", small_model, steps=50))
    full.train()
    staged_kw = dict(optimize=dict(smart_stage=True, main_threads=torch.get_num_threads(),
                                   smart_stage_options=dict(capacity=6, num_threads=2, executor="thread")))
    Trainer(_cfg(unique_tsv, tmp_path / "split", small_model, steps=21, **staged_kw)).train()
    state = load_checkpoint(latest_checkpoint(str(tmp_path / "split")))
    assert state["reader"]["epoch"] == 0 and state["reader"]["batches"] == 21
    resumed = Trainer(_cfg(unique_tsv, tmp_path / "split", small_model, steps=50, resume=True, **staged_kw))
    resumed.train()
    _assert_same_state(full, resumed)


@pytest.mark.slow
def test_smart_stage_in_a_process_resumes_exactly(tmp_path, unique_tsv, small_model):
    full = Trainer(_cfg(unique_tsv, tmp_path / "full", small_model, steps=30))
    full.train()
    kw = dict(optimize=dict(smart_stage=True, main_threads=torch.get_num_threads(),
                            smart_stage_options=dict(capacity=4, executor="process")))
    first = Trainer(_cfg(unique_tsv, tmp_path / "split", small_model, steps=12, **kw))
    assert first.train()["stage"]["taken"] == 12
    resumed = Trainer(_cfg(unique_tsv, tmp_path / "split", small_model, steps=30, resume=True, **kw))
    resumed.train()
    _assert_same_state(full, resumed)


def test_incremental_checkpoints_restore_mid_training(tmp_path, unique_tsv, small_model):
    kw = dict(embedding="variable", optimizer="adagrad")
    full = Trainer(_cfg(unique_tsv, tmp_path / "full", small_model, steps=50, **kw))
    full.train()
    crashed = Trainer(_cfg(unique_tsv, tmp_path / "inc", small_model, steps=37, checkpoint_every=20,
                           incremental_every=5, **kw))
    save = crashed.save

    def crash_at_the_final_save(incremental=False):
        if not incremental and crashed.step == 37:
            raise RuntimeError("killed")
        return save(incremental)

    crashed.save = crash_at_the_final_save
    with pytest.raises(RuntimeError, match="killed"):
        crashed.train()
    incs = list_checkpoints(str(tmp_path / "inc"), "incremental")
    assert [os.path.basename(p) for p in incs] == [f"incremental-0000000{s}.pt" for s in (25, 30, 35)]
    inc_rows = load_checkpoint(incs[0])["model"]["embeddings.collection.lookup.variables.0.keys"].numel()
    full_rows = load_checkpoint(latest_checkpoint(str(tmp_path / "inc")))["model"][
        "embeddings.collection.lookup.variables.0.keys"].numel()
    assert 0 < inc_rows < full_rows  # only the rows touched in 5 steps
    resumed = Trainer(_cfg(unique_tsv, tmp_path / "inc", small_model, steps=50, resume=True, **kw))
    assert resumed.step == 35
    resumed.train()
    _assert_same_state(full, resumed)


def test_micro_batches_and_streams_train_to_the_same_state(tmp_path, unique_tsv, small_model):
    """--micro-batch 4 (with the stage ahead) and --multi-stream 2: the same training, up to float rounding."""
    plain = Trainer(_cfg(unique_tsv, tmp_path / "plain", small_model, steps=12, optimizer="adagrad"))
    micro = Trainer(_cfg(unique_tsv, tmp_path / "micro", small_model, steps=12, optimizer="adagrad",
                         optimize=dict(micro_batch_num=4, smart_stage=True, smart_stage_options=dict(capacity=2))))
    streams = Trainer(_cfg(unique_tsv, tmp_path / "streams", small_model, steps=12, optimizer="adagrad",
                           optimize=dict(multi_stream=dict(num_streams=2, policy="full"))))
    a, b, c = plain.train(), micro.train(), streams.train()
    assert b["steps"] == c["steps"] == 12 and b["rows"] == a["rows"] == 12 * 256
    for other in (micro, streams):
        for (name, p), q in zip(plain.model.state_dict().items(), other.model.state_dict().values(), strict=True):
            if isinstance(p, torch.Tensor) and p.is_floating_point():
                assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), name
    assert load_checkpoint(latest_checkpoint(str(tmp_path / "micro")))["reader"] == plain._reader_state
