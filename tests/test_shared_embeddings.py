"""One EmbeddingVariable under two names (a ModuleDict's C1 and C2: one vocabulary for two features)
stays one module wherever a runtime swaps modules, and its state loads under every name: frozen
for serving (export, online deltas), tiered, read back from a checkpoint that names it once (a
PS job's)."""
import copy

import pytest
import torch

import custom_models as cm
from deeprec.checkpoint import load_model_weights
from deeprec.cli import sample_path
from deeprec.data import open_reader, resolve_schema
from deeprec.optim import make_optimizer
from deeprec.serving import load
from deeprec.serving.frozen import FrozenEmbeddingVariable, freeze_variables
from deeprec.serving.online import ExportFolder, ExportWriter


@pytest.fixture(scope="module")
def schema():
    return resolve_schema([sample_path()], None)


def batches(schema, n: int, rows: int = 32) -> list:
    reader = iter(open_reader([sample_path()], rows, schema=schema))
    return [next(reader) for _ in range(n)]


def trained(schema, make=cm.SharedNames, steps: int = 3):
    torch.manual_seed(0)
    model = make()
    optimizer = make_optimizer(model, "adagrad", 0.05)
    for batch in batches(schema, steps):
        model(batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def scores(model, batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = torch.sigmoid(model(batch)["logits"])
    model.train()
    return out


def test_freezing_makes_one_frozen_module_under_both_names(schema):
    model, _ = trained(schema)
    frozen = copy.deepcopy(model)
    assert freeze_variables(frozen) == 1
    assert isinstance(frozen.evs["C1"], FrozenEmbeddingVariable) and frozen.evs["C1"] is frozen.evs["C2"]
    batch = batches(schema, 1, 50)[0]
    torch.testing.assert_close(scores(frozen, batch), scores(model, batch), rtol=0, atol=0)


@pytest.mark.parametrize("make", [cm.SharedNames, cm.MixedEmbeddings])
def test_export_of_a_shared_variable_serves_and_follows_deltas(tmp_path, schema, make):
    """Failed before: the second name stayed a live EmbeddingVariable in the traced program (".numpy()
    is not supported for tensor subclasses"), and safetensors refused the shared tensors."""
    model, optimizer = trained(schema, make)
    writer = ExportWriter(str(tmp_path / "live"), model, schema, "shared", compile=False)
    writer.full(3)
    batch = batches(schema, 1, 64)[0]
    served = load(str(tmp_path / "live" / "full-000000003"))
    torch.testing.assert_close(served(batch), scores(model, batch), rtol=0, atol=1e-6)
    assert served.module.evs.C1 is served.module.evs.C2  # one module again: a delta reaches both names
    for batch_ in batches(schema, 5)[3:]:  # new keys and updated rows of both features
        model(batch_)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    writer.delta(5)
    followed = ExportFolder(str(tmp_path / "live")).load()
    assert followed.step == 5
    torch.testing.assert_close(followed(batch), scores(model, batch), rtol=0, atol=1e-6)


def test_a_checkpoint_naming_a_shared_variable_once_loads_under_both_names(schema):
    """A PS job's checkpoint holds the shared variable's rows once (failed before: "checkpoint does not
    fit the model: missing ['evs.C2.keys']")."""
    model, _ = trained(schema)
    state = model.state_dict()
    assert torch.equal(state["evs.C1.keys"], state["evs.C2.keys"])  # torch saves it under both names, equal
    once = {k: v for k, v in state.items() if not k.startswith("evs.C2.")}
    fresh = cm.SharedNames()
    load_model_weights(fresh, once)
    batch = batches(schema, 1, 50)[0]
    torch.testing.assert_close(scores(fresh, batch), scores(model, batch), rtol=0, atol=0)
    differ = dict(state)
    differ["evs.C2.values"] = differ["evs.C2.values"] + 1.0
    with pytest.raises(RuntimeError, match="evs.C1 and evs.C2 are one module, but the state holds different "
                                           "'values'"):
        load_model_weights(cm.SharedNames(), differ)


def test_ps_checkpoint_of_a_shared_variable_reads_as_one_process(schema):
    """ParameterServer.one_process_weights: the PSs hold the variable under one name; the one-process
    state has its rows under both."""
    from deeprec.distributed.ps.strategy import one_process_state

    model, _ = trained(schema)
    rows = model.evs["C1"].export()
    snapshot = {f"emb/evs.C1/{k}": v for k, v in rows.items()}
    dense = {k: v for k, v in model.state_dict().items() if not k.startswith("evs.")}
    state = one_process_state(cm.SharedNames(), {"model": dense, "ps": snapshot})
    assert torch.equal(state["evs.C1.keys"], rows["keys"]) and torch.equal(state["evs.C2.keys"], rows["keys"])
    fresh = cm.SharedNames()
    load_model_weights(fresh, state)
    batch = batches(schema, 1, 50)[0]
    torch.testing.assert_close(scores(fresh, batch), scores(model, batch), rtol=0, atol=0)


def test_tiering_keeps_one_variable_under_both_names(tmp_path, schema):
    """`--storage ssd` swaps each EmbeddingVariable for a tiered one: a shared one once, under both
    names (before, the second name kept the DRAM variable and the two names trained apart)."""
    from deeprec.nn.tiered import TieredEmbeddingVariable
    from deeprec.trainer import TrainConfig, Trainer

    cfg = TrainConfig.create(data=[sample_path()], steps=10, batch_size=16, progress=False, storage="ssd",
                             dram_bytes=2 * 17_000, storage_path=str(tmp_path / "disk"))
    trainer = Trainer(cfg, model=cm.MixedEmbeddings())
    evs = trainer.model.evs
    assert isinstance(evs["C1"], TieredEmbeddingVariable) and evs["C1"] is evs["C2"]
    assert isinstance(evs["C3_X_C4"], TieredEmbeddingVariable)
    result = trainer.train()
    assert result["tiers"]["variables"] == 2 and result["tiers"]["disk_rows"] > 0


def test_use_storage_tiers_a_shared_variable_under_every_name(tmp_path):
    """dr.nn.use_storage called by hand (not through the trainer) swaps every name too."""
    from deeprec.nn import EmbeddingVariable, StorageOption, TieredEmbeddingVariable
    from deeprec.nn.tiered import use_storage

    ev = EmbeddingVariable(4, name="shared")
    model = torch.nn.ModuleDict({"a": ev, "b": ev, "c": EmbeddingVariable(4, name="own")})
    assert use_storage(model, StorageOption(tiers=["dram", "ssd"], dram_bytes=4000, path=str(tmp_path))) == 2
    assert isinstance(model["a"], TieredEmbeddingVariable) and model["a"] is model["b"]
    assert isinstance(model["c"], TieredEmbeddingVariable) and model["c"] is not model["a"]


def test_a_local_checkpoint_holds_a_shared_variable_once_and_restores_both_names(schema):
    """The updater's state (what a checkpoint saves) names the shared variable once; loaded into a
    fresh model, both names hold its rows and the model scores as the trained one."""
    from deeprec.runtime.updater import LocalUpdater

    model, optimizer = trained(schema)
    state = LocalUpdater(model, optimizer).state_dict()
    assert any(k.startswith("evs.C1.") for k in state["model"])
    assert not any(k.startswith("evs.C2.") for k in state["model"])  # once: before, its rows were saved twice
    torch.manual_seed(1)
    fresh = cm.SharedNames()
    LocalUpdater(fresh, make_optimizer(fresh, "adagrad", 0.05)).load_state_dict(state)
    assert fresh.evs["C1"] is fresh.evs["C2"]
    batch = batches(schema, 1, 50)[0]
    torch.testing.assert_close(scores(fresh, batch), scores(model, batch), rtol=0, atol=0)
