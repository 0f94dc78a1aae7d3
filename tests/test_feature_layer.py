"""One feature layer for every model: sequence lookups, shared tables, and each model
with embedding=variable, micro-batches, parameter servers and async embedding."""
import copy
import json

import pytest
import torch

import deeprec as dr
from deeprec.cli import sample_path
from deeprec.data import open_reader, resolve_schema
from deeprec.models import MODELS, build_model
from deeprec.nn import EmbeddingCollection, EmbeddingFeature, EmbeddingVariableOption, InitializerOption
from deeprec.distributed.ps.strategy import ParameterServer
from deeprec.optim import make_optimizer
from deeprec.optim.sparse import SGD
from state_compare import rows_by_key

ALL = sorted(MODELS)
CRITEO = ("dlrm", "deepfm", "wdl")
SMALL = {"dlrm": dict(bottom_mlp=(16, 16), top_mlp=(16,), hash_buckets=1000),
         "deepfm": dict(dnn=(16,), hash_buckets=1000), "wdl": dict(dnn=(16,), hash_buckets=1000),
         "din": dict(top=(16,), attention=(8,), hash_buckets=1000), "mmoe": dict(hash_buckets=1000, expert=(16,)),
         "dien": dict(top=(16,), attention=(8,), auxiliary=(8,), hash_buckets=1000),
         "dssm": dict(tower=(16,), output_dim=8, hash_buckets=1000)}


def data_for(name, behavior):
    """Each model on data of its default schema: Criteo's sample, behaviour logs, ByteRec's sample."""
    if name in CRITEO:
        return sample_path()
    if name == "mmoe":
        return sample_path("byterec_sample.txt")
    return behavior[0]


def batches(name, behavior, n, batch_size=64):
    path = data_for(name, behavior)
    reader = open_reader([path], batch_size, schema=resolve_schema([path], None), drop_remainder=True)
    out = []
    for batch in reader:
        out.append(batch)
        if len(out) == n:
            return out
    return out


def model_for(name, behavior, **overrides):
    torch.manual_seed(0)
    path = data_for(name, behavior)
    return build_model(name, schema=resolve_schema([path], None), **SMALL[name], **overrides)


# -- the collection's sequence mode and shared tables ---------------------------------------
def test_sequence_features_get_per_position_rows_of_a_shared_table():
    torch.manual_seed(0)
    coll = EmbeddingCollection([EmbeddingFeature("item", 10), EmbeddingFeature("user", 5),
                                EmbeddingFeature("history", table="item", pooled=False)], 4)
    item, user = torch.tensor([1, 2, 3]), torch.tensor([0, 4, 4])
    history = torch.tensor([[1, 5, -1], [-1, -1, -1], [3, 3, 9]])  # -1: padding
    pooled, sequences = coll({"item": item, "user": user, "history": history})
    weight = coll.lookup.weight.detach()  # item rows 0..9, user rows 10..14: the history reads the item table
    assert torch.equal(pooled, torch.stack([weight[item], weight[10 + user]], dim=1))
    expected = torch.where((history >= 0).unsqueeze(-1), weight[history.clamp_min(0)], torch.zeros(()))
    assert torch.equal(sequences["history"], expected)

    coll.set_optimizer(SGD(lr=1.0))
    before = weight.clone()
    (pooled.sum() + 2 * sequences["history"].sum()).backward()
    change = before - coll.lookup.weight.detach()
    # item 3: once as a target, twice in a history (x2) -> one update of 1 + 4 = 5 per element
    assert torch.allclose(change[3], torch.full((4,), 5.0)) and torch.allclose(change[1], torch.full((4,), 3.0))
    assert torch.allclose(change[9], torch.full((4,), 2.0)) and torch.equal(change[0], torch.zeros(4))


def test_shared_embedding_variable_is_updated_once_per_step():
    option = EmbeddingVariableOption(InitializerOption(lambda t: torch.nn.init.constant_(t, 0.5)))
    coll = EmbeddingCollection([EmbeddingFeature("item", None, ev_option=option),
                                EmbeddingFeature("history", None, ev_option=option, table="item", pooled=False)], 2)
    opt = dr.optim.Adam(lr=0.1)
    coll.set_optimizer(opt)
    pooled, sequences = coll({"item": torch.tensor([7, 8]), "history": torch.tensor([[7, 7], [9, -1]])})
    (pooled.sum() + sequences["history"].sum()).backward()
    ev, = coll.lookup.variables  # one variable serves both features
    assert opt.step_count == 1 and sorted(ev.keys[: ev.size].tolist()) == [7, 8, 9]
    # Adam's first step moves every touched element by lr, whatever the summed gradient
    assert torch.allclose(ev.weight[: ev.size], torch.full((3, 2), 0.4))


def test_sequence_feature_rejects_ragged_ids_with_a_clear_error():
    coll = EmbeddingCollection([EmbeddingFeature("item", 10), EmbeddingFeature("h", table="item", pooled=False)], 2)
    with pytest.raises(dr.ConfigError, match="pad_ragged"):
        coll({"item": torch.tensor([1]), "h": dr.Ragged.from_lists([[1, 2]])})


# -- every model, every way of training --------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_every_model_trains_with_embedding_variables(name, behavior):
    model = model_for(name, behavior, embedding="variable")
    embedder = next(m for m in model.modules() if isinstance(m, dr.models.features.FeatureEmbedder))
    variables = embedder.collection.lookup.variables
    opt = make_optimizer(model, "adam", 0.01)
    losses = []
    for batch in batches(name, behavior, 3):
        out = model(batch)
        out["loss"].backward()
        opt.step()
        opt.zero_grad()
        losses.append(out["loss"].item())
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert all(ev.size > 0 for ev in variables)  # keys admitted with no fixed vocabulary
    assert embedder.collection.lookup.optimizer.step_count == 3
    # the same math through deeprec.optimize: the stage runs hashing and bag preparation ahead
    twin = copy.deepcopy(model).eval()
    fast = dr.optimize(twin, dr.Config(smart_stage=True))
    batch = batches(name, behavior, 1)[0]
    assert fast.staged and torch.equal(fast(batch)["logits"], model.eval()(batch)["logits"])


@pytest.mark.parametrize("name", ALL)
def test_micro_batches_merge_embedding_rows_for_every_model(name, behavior):
    """Two micro-batches give the full batch's update (rows seen in both are merged into one)."""
    no_bn = {"batch_norm": False} if name in ("din", "dien") else {}  # batch statistics depend on the split
    full = model_for(name, behavior, **no_bn)
    if name == "dien":
        full.config.aux_weight = 0.0  # its negatives come from other rows of the (micro-)batch
    micro = copy.deepcopy(full)
    opt_full, opt_micro = make_optimizer(full, "adagrad", 0.05), make_optimizer(micro, "adagrad", 0.05)
    fast = dr.optimize(micro, dr.Config(micro_batch_num=2))
    for batch in batches(name, behavior, 2):
        full(batch)["loss"].backward()
        opt_full.step()
        opt_full.zero_grad()
        fast.forward_backward(batch)
        opt_micro.step()
        opt_micro.zero_grad()
    expected, got = rows_by_key(full.state_dict()), rows_by_key(micro.state_dict())  # rows inserted in another order
    for (key, a), b in zip(expected.items(), got.values(), strict=True):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            assert torch.allclose(a, b, atol=1e-5), key


def test_kept_micro_batch_rows_that_are_never_applied_are_an_error(behavior):
    model = model_for("din", behavior, batch_norm=False)
    make_optimizer(model, "sgd", 0.1)
    fast = dr.optimize(model, dr.Config(micro_batch_num=2))
    first, second = batches("din", behavior, 2)
    fast.forward_backward(first)  # no optimizer.step(): the embedding rows are still kept
    with pytest.raises(RuntimeError, match="never applied"):
        fast.forward_backward(second)


@pytest.mark.parametrize("name", ALL)
def test_every_model_trains_on_a_parameter_server_with_async_embedding(name, behavior, ps_pool, tmp_path):
    from deeprec.trainer import TrainConfig, Trainer

    addresses, _ = ps_pool(1)
    t = Trainer(TrainConfig.create(model=name, data=[data_for(name, behavior)], steps=4, batch_size=32, seed=1,
                                   model_overrides=SMALL[name], progress=False,
                                   optimize=dict(smart_stage=True, async_embedding=True,
                                                 smart_stage_options=dict(capacity=2, executor="thread"))),
                strategy=ParameterServer(addresses))
    result = t.train()
    assert result["steps"] == 4 and torch.isfinite(torch.tensor(result["final_loss"]))
    remote = t.updater.remotes[0]
    assert remote.prefetch_hits >= 1  # rows pulled in the prefetch, ahead of the step
    snapshot = t.updater.client.snapshot()
    assert any(key.startswith("emb/") and key.endswith("/keys") and value.numel() for key, value in snapshot.items())


def test_din_on_one_parameter_server_equals_local_training(behavior, ps_pool):
    from deeprec.trainer import TrainConfig, Trainer

    common = dict(model="din", data=[behavior[0]], steps=6, batch_size=64, optimizer="adagrad", lr=0.05, seed=3,
                  model_overrides={**SMALL["din"], "batch_norm": False}, progress=False)
    local = Trainer(TrainConfig.create(embedding="variable", **common))
    local.train()
    addresses, _ = ps_pool(1)
    remote = Trainer(TrainConfig.create(**common), strategy=ParameterServer(addresses))
    remote.train()
    remote.updater.pull_dense()
    for name, p in local.model.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p, remote.updater.dense[name], atol=1e-5), name
    lookup = local.model.inputs.embedder.collection.lookup
    for ev, table in zip(lookup.variables, remote.updater.remotes[0].names):  # shared tables: item and category
        keys = ev.keys[: ev.size]
        pulled = remote.updater.client.pull({table: keys}, train=False)[table]
        assert torch.allclose(pulled, ev.weight[: ev.size], atol=1e-5), table


@pytest.mark.slow
def test_launch_trains_din_on_one_parameter_server(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, DEEPREC_CACHE=str(tmp_path))
    out = tmp_path / "din.json"
    done = subprocess.run([sys.executable, "-m", "deeprec.cli", "launch", "--ps", "1", "--workers", "1", "--",
                           "train", "--model", "din", "--synthetic", "3000", "--steps", "5", "--batch-size", "64",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1/1 workers succeeded" in done.stdout
    result = json.loads(out.read_text())
    assert result["steps"] == 5 and result["eval"]["rows"] == 1000
