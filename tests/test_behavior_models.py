"""DIN, DIEN, DSSM, MMoE: forward/backward on real samples and synthetic data, learning, SmartStage."""
import copy
import json

import pytest
import torch

import deeprec as dr
from deeprec.cli import main, sample_path
from deeprec.data import PRESETS, CsvReader, schema_for
from deeprec.models import build_model
from deeprec.nn import Ragged
from deeprec.optim import make_optimizer
from deeprec.trainer import TrainConfig, Trainer

REAL = {"din": "movielens_sample.txt", "dien": "movielens_sample.txt", "dssm": "movielens_sample.txt",
        "mmoe": "byterec_sample.txt"}


def first_batch(path, schema, n=64):
    return next(iter(CsvReader(path, schema, batch_size=n)))


@pytest.mark.parametrize("name", sorted(REAL))
def test_forward_backward_on_real_and_synthetic_data(name, behavior):
    for path in (sample_path(REAL[name]), behavior[0]):
        schema = schema_for(path)
        model = build_model(name, schema=schema)  # EmbeddingVariables: they need their row-sparse optimizer
        make_optimizer(model, "adagrad", 0.01)
        out = model(first_batch(path, schema))
        assert torch.isfinite(out["loss"]) and out["logits"].shape[0] == 64
        out["loss"].backward()
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, missing
    if name == "mmoe":
        assert out["logits"].shape == (64, 2) and model.label_columns == ("click", "like")


@pytest.mark.parametrize("name", ["din", "dien"])
def test_empty_and_long_histories(name):
    schema = PRESETS["behavior"]
    model = build_model(name, hash_buckets=1000, max_length=5).eval()
    lengths = [0, 1, 9]  # empty, short, longer than max_length
    offsets = torch.tensor([0, 0, 1, 10])
    batch = {"click": torch.tensor([1.0, 0.0, 1.0]), "like": torch.zeros(3), "user_id": torch.tensor([1, 2, 3]),
             "item_id": torch.tensor([4, 5, 6]), "category_id": torch.tensor([1, 1, 2]),
             "hist_items": Ragged(torch.arange(sum(lengths)), offsets),
             "hist_cats": Ragged(torch.arange(sum(lengths)) % 3, offsets)}
    out = model(batch)
    assert torch.isfinite(out["logits"]).all() and schema["hist_items"].max_length == 50
    # the history is cut to its last 5 items: changing an older one changes nothing
    older = dict(batch, hist_items=Ragged(torch.cat([torch.tensor([99]), torch.arange(1, 10)]), offsets))
    older["hist_items"].values[1] = 777  # row 2's oldest of 9 items
    assert torch.equal(model(older)["logits"][2], out["logits"][2])


LEARNING = {"din": (100, 0.68, {}), "dien": (60, 0.6, {"max_length": 20}), "dssm": (100, 0.62, {}),
            "mmoe": (100, 0.6, {})}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LEARNING))
def test_each_model_learns_the_planted_preference(name, behavior):
    steps, bound, extra = LEARNING[name]
    train, evaluation = behavior
    cfg = TrainConfig.create(model=name, data=[train], eval_data=[evaluation], steps=steps, batch_size=256,
                      optimizer="adam", lr=0.003, progress=False, seed=0,
                      model_overrides={"hash_buckets": 20000, **extra})
    result = Trainer(cfg).train()
    tasks = result["eval"].get("tasks", {"click": result["eval"]})
    for task, metrics in tasks.items():
        assert metrics["auc"] > bound, (task, metrics)


def test_din_sequence_preprocessing_is_staged_and_training_is_identical(behavior):
    torch.manual_seed(0)
    plain = build_model("din", hash_buckets=5000, embedding="table")  # the bucketing ops staged too
    twin = copy.deepcopy(plain)
    fast = dr.optimize(twin, dr.Config(smart_stage=True, smart_stage_options=dr.SmartStageOptions(capacity=2),
                                       main_threads=torch.get_num_threads()))
    stage_side = fast.explain().split("main (")[0]  # hashing, truncation and padding run ahead
    assert "hash_ragged x2" in stage_side and "pad_ragged x2" in stage_side and "id_to_bucket x3" in stage_side
    opt_a, opt_b = make_optimizer(plain, "adam", 0.003), make_optimizer(twin, "adam", 0.003)
    reader = lambda: CsvReader(behavior[0], PRESETS["behavior"], batch_size=128)  # noqa: E731
    losses_a, losses_b = [], []
    for k, batch in enumerate(reader()):
        out = plain(batch)
        out["loss"].backward()
        opt_a.step()
        opt_a.zero_grad()
        losses_a.append(out["loss"].item())
        if k == 5:
            break
    for k, out in enumerate(fast.iterate(reader(), backward=True)):
        opt_b.step()
        opt_b.zero_grad()
        losses_b.append(out["loss"].item())
        if k == 5:
            break
    assert losses_a == losses_b
    for (n, a), b in zip(plain.state_dict().items(), twin.state_dict().values()):
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), n


@pytest.mark.parametrize("name", sorted(REAL))
def test_smart_stage_gives_the_same_outputs(name, behavior):
    torch.manual_seed(0)
    model = build_model(name, schema=PRESETS["behavior"], hash_buckets=5000).eval()
    fast = dr.optimize(model, dr.Config(smart_stage=True))
    batch = first_batch(behavior[0], PRESETS["behavior"])
    assert fast.staged and torch.equal(fast(batch)["logits"], model(batch)["logits"])


def test_cli_trains_each_model_on_its_real_sample_and_on_synthetic_data(tmp_path, capsys):
    for name in ("din", "mmoe"):
        out = tmp_path / f"{name}.json"
        assert main(["train", "--model", name, "--steps", "3", "--batch-size", "32", "--json", str(out)]) == 0
        result = json.loads(out.read_text())
        assert result["steps"] == 3 and "auc" in result["eval"]
    out = tmp_path / "dssm.json"
    assert main(["train", "--model", "dssm", "--synthetic", "3000", "--steps", "3", "--batch-size", "64",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["eval"]["rows"] == 1000
    # every model reads its columns from the data's schema: DLRM on Avazu (22 categorical, no dense column)
    out = tmp_path / "dlrm-avazu.json"
    assert main(["train", "--model", "dlrm", "--data", sample_path("avazu_sample.txt"), "--steps", "2",
                 "--batch-size", "32", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["steps"] == 2
    # a schema the model cannot use is a usage error naming what is missing
    assert main(["train", "--model", "din", "--data", sample_path("avazu_sample.txt"), "--steps", "1"]) == 2
    assert "no sequence column" in capsys.readouterr().err
