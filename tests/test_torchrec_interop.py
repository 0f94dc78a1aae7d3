"""TorchRec interop (issue #29): KeyedJaggedTensor / KeyedTensor conversions, the drop-in
EmbeddingBagCollection against torchrec's own, and a TorchRec-style model trained through deeprec
(SmartStage, EmbeddingVariables, PS, collective) against the same model on deeprec's own input."""
import importlib.util
import itertools
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("torchrec", reason="the optional extra deeprec[torchrec] (torchrec, fbgemm-gpu-cpu) is not installed")

from torchrec import EmbeddingBagConfig, PoolingType  # noqa: E402
import torchrec  # noqa: E402
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor  # noqa: E402

import deeprec as dr  # noqa: E402
from deeprec import Ragged, ops  # noqa: E402
from deeprec.data import open_reader, resolve_schema  # noqa: E402
from deeprec.errors import ConfigError  # noqa: E402
from deeprec.interop import torchrec as ti  # noqa: E402
from deeprec.models.features import FeatureEmbedder  # noqa: E402
from deeprec.nn import EmbeddingCollection, EmbeddingFeature  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "torchrec_model.py")


def _example():
    spec = importlib.util.spec_from_file_location("torchrec_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _batches(sample, n, batch_size=32):
    schema = resolve_schema([sample])
    return schema, list(itertools.islice(open_reader([sample], batch_size=batch_size, schema=schema), n))


def _small_batch():
    return {"C1": Ragged.from_strings(["a", "b", "", "c"]), "I": torch.tensor([3, -1, 5, 7]),
            "S": Ragged.from_lists([[1, 2], [], [3, -4], [4, 5, 6]])}


# -- conversions --------------------------------------------------------------------------------
@pytest.mark.parametrize("num_buckets", [None, 1000])
def test_kjt_ids_are_the_ids_deeprec_models_embed(sample, num_buckets):
    """to_kjt hashes as FeatureEmbedder does; a missing id (negative) is an empty bag."""
    schema, (batch,) = _batches(sample, 1)
    embedder = FeatureEmbedder(schema, 4, hash_buckets=num_buckets or 10, embedding="variable" if num_buckets is None
                               else "table")
    want = embedder.ids(batch)
    names = list(embedder.categorical)
    kjt = ti.to_kjt(batch, names, num_buckets=num_buckets)
    assert isinstance(kjt, KeyedJaggedTensor) and kjt.keys() == names
    for name, ragged in ti.from_kjt(kjt).items():
        ids = want[name]
        assert torch.equal(ragged.values, ids[ids >= 0])
        assert torch.equal(ragged.lengths(), (ids >= 0).long())
    assert (torch.cat([want[n] for n in names]) < 0).any() == (kjt.lengths() == 0).any()


def test_missing_ids_leave_bags_shorter_and_buckets_apply_to_every_kind():
    kjt = ti.to_kjt(_small_batch(), ["C1", "I", "S"], num_buckets={"I": 4, "S": 3, "C1": 10})
    jt = kjt.to_dict()
    assert jt["I"].lengths().tolist() == [1, 1, 1, 1] and jt["I"].values().tolist() == [3, 0, 1, 3]  # id_to_bucket
    assert jt["S"].lengths().tolist() == [2, 0, 2, 3] and jt["S"].values().tolist() == [1, 2, 0, 2, 1, 2, 0]
    keys = ti.to_kjt(_small_batch(), ["I", "S"]).to_dict()  # no buckets: ids kept, negatives dropped
    assert keys["I"].lengths().tolist() == [1, 0, 1, 1] and keys["I"].values().tolist() == [3, 5, 7]
    assert keys["S"].lengths().tolist() == [2, 0, 1, 3] and keys["S"].values().tolist() == [1, 2, 3, 4, 5, 6]
    assert jt["C1"].values().tolist() == ops.string_to_hash_bucket(_small_batch()["C1"], 10).tolist()


def test_conversions_share_memory_where_the_layouts_agree():
    seq = Ragged.from_lists([[1, 2], [], [3], [4, 5, 6]])
    kjt = ti.to_kjt({"S": seq}, ["S"])
    assert kjt.values().data_ptr() == seq.values.data_ptr() and kjt.offsets().data_ptr() == seq.offsets.data_ptr()
    back = ti.from_kjt(kjt)["S"]
    assert back.values.data_ptr() == seq.values.data_ptr() and back.offsets.data_ptr() == seq.offsets.data_ptr()
    two = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.arange(7), torch.tensor([2, 0, 1, 3, 0, 1]))
    split = ti.from_kjt(two)
    base = two.values().data_ptr()
    assert split["a"].values.data_ptr() == base and split["b"].values.data_ptr() == base + 3 * 8  # views
    assert split["b"].tolist() == [[3, 4, 5], [], [6]] and split["a"].tolist() == [[0, 1], [], [2]]
    jt = ti.to_jagged(seq)
    assert isinstance(jt, JaggedTensor) and jt.values().data_ptr() == seq.values.data_ptr()
    assert ti.from_jagged(jt).offsets.data_ptr() == seq.offsets.data_ptr()
    pooled = torch.randn(4, 3, 2)
    kt = ti.to_keyed_tensor(pooled, ["x", "y", "z"])
    assert isinstance(kt, KeyedTensor) and kt.values().data_ptr() == pooled.data_ptr()
    assert torch.equal(ti.from_keyed_tensor(kt)["y"], pooled[:, 1])


# -- EmbeddingCollection and the drop-in EmbeddingBagCollection ---------------------------------------
TABLES = [EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["a", "b"],
                             pooling=PoolingType.MEAN),
          EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=7, feature_names=["c"]),
          EmbeddingBagConfig(name="t3", embedding_dim=4, num_embeddings=5, feature_names=["d"])]


def _kjt():  # a bag of two and an empty bag in one feature; lengths key-major, 3 rows
    return KeyedJaggedTensor.from_lengths_sync(["a", "b", "c", "d"], torch.tensor([1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 4]),
                                               torch.tensor([2, 1, 0, 1, 1, 1, 2, 0, 1, 1, 1, 1]))


def test_drop_in_ebc_equals_torchrec_ebc():
    """Same configs, weights and KJT: the same KeyedTensor (mixed dims, a shared table, MEAN, empty bags)."""
    theirs = torchrec.EmbeddingBagCollection(tables=TABLES, device=torch.device("cpu"))
    ours = ti.EmbeddingBagCollection(TABLES)
    ours.load_torchrec_state_dict(theirs.state_dict())
    want, got = theirs(_kjt()), ours(_kjt())
    assert got.keys() == want.keys() == ["a", "b", "c", "d"] and got.length_per_key() == want.length_per_key()
    assert torch.equal(got.values(), want.values())
    bound = (1 / 10) ** 0.5  # torchrec's default init range, per table
    assert ours.table("t1").abs().max() <= bound and ours.embedding_bag_configs() == TABLES


def test_a_torchrec_state_of_another_shape_is_refused_not_broadcast():
    ours = ti.EmbeddingBagCollection(TABLES)
    state = {f"embedding_bags.{t.name}.weight": torch.zeros(t.num_embeddings, t.embedding_dim) for t in TABLES}
    state["embedding_bags.t2.weight"] = torch.ones(1, 8)  # copy_ would fill every row of t2 with it
    before = {t.name: ours.table(t.name).clone() for t in TABLES}
    with pytest.raises(ConfigError, match=r"'embedding_bags.t2.weight' is \(1, 8\), table 't2' is \(7, 8\)"):
        ours.load_torchrec_state_dict(state)
    assert all(torch.equal(ours.table(name), rows) for name, rows in before.items())  # none changed


def test_drop_in_ebc_trains_as_torchrec_ebc_with_sgd(sample):
    """The TorchRec model trained by torchrec (dense SGD on its tables) and by deeprec (row-sparse SGD)."""
    example = _example()
    schema, batches = _batches(sample, 4)
    sparse = schema.of_kind("categorical")[:6]
    tables = example.tables_for(sparse, 8, 100)
    torch.manual_seed(0)
    theirs = example.SparseNN(torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("cpu")), 13)
    ours = example.SparseNN(ti.EmbeddingBagCollection(tables), 13)
    ours.ebc.load_torchrec_state_dict(theirs.ebc.state_dict())
    ours.load_state_dict({k: v for k, v in theirs.state_dict().items() if not k.startswith("ebc.")}, strict=False)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
    opt_ours = dr.optim.make_optimizer(ours, "sgd", lr=0.1)
    for batch in batches:
        dense = torch.stack([batch[f"I{i}"] for i in range(1, 14)], 1).nan_to_num(0.0).clamp(min=0.0).log1p()
        kjt = ti.to_kjt(batch, sparse, num_buckets=100)
        losses = []
        for model, opt in ((theirs, opt_theirs), (ours, opt_ours)):
            loss = nn.functional.binary_cross_entropy_with_logits(model(dense, kjt), batch["label"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for t in tables:
        torch.testing.assert_close(ours.ebc.table(t.name), theirs.ebc.state_dict()[f"embedding_bags.{t.name}.weight"],
                                   atol=1e-6, rtol=1e-5)


def test_embedding_collection_takes_a_kjt_and_returns_a_keyed_tensor():
    collection = EmbeddingCollection([EmbeddingFeature("a", 10, "mean"), EmbeddingFeature("b", 10)], 4)
    kjt = KeyedJaggedTensor.from_lengths_sync(["b", "a"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 2, 1, 1]))
    kt = collection(kjt)
    assert isinstance(kt, KeyedTensor) and kt.keys() == ["a", "b"] and kt.values().shape == (2, 8)
    ids = {"a": Ragged(torch.tensor([4, 5]), torch.tensor([0, 1, 2])), "b": Ragged(torch.tensor([1, 2, 3]),
                                                                               torch.tensor([0, 1, 3]))}
    assert torch.equal(kt.values(), collection(ids).flatten(1))


def test_bad_kjt_input_fails_naming_the_keys():
    collection = EmbeddingCollection([EmbeddingFeature("a", 10), EmbeddingFeature("b", 10)], 4)
    extra = KeyedJaggedTensor.from_lengths_sync(["a", "b", "zz"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1]))
    with pytest.raises(ConfigError, match=r"key 'zz' is not one of its features \(a, b\)"):
        collection(extra)
    with pytest.raises(ConfigError, match=r"no key 'b'; its keys: a"):
        collection(KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([1]), torch.tensor([1])))
    weighted = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([1, 2]), torch.tensor([1, 1]),
                                                   weights=torch.ones(2))
    with pytest.raises(ConfigError, match="weighted KeyedJaggedTensor"):
        collection(weighted)
    with pytest.raises(ConfigError, match=r"key 'zz' is not one of its features \(a, b, c, d\)"):
        ti.EmbeddingBagCollection(TABLES)(KeyedJaggedTensor.from_lengths_sync(
            ["a", "b", "c", "d", "zz"], torch.arange(5), torch.ones(5, dtype=torch.long)))
    sequences = EmbeddingCollection([EmbeddingFeature("a", 10), EmbeddingFeature("s", 10, pooled=False)], 4)
    with pytest.raises(ConfigError, match="sequence features \\(s\\) take padded ids"):
        sequences(extra)
    with pytest.raises(ConfigError, match="the batch has no column 'C9'"):
        ti.to_kjt(_small_batch(), ["C1", "C9"])
    with pytest.raises(ConfigError, match="is_weighted=True"):
        ti.EmbeddingBagCollection(TABLES, is_weighted=True)
    with pytest.raises(ConfigError, match="feature name 'a' appears more than once"):
        ti.EmbeddingBagCollection(TABLES + [EmbeddingBagConfig(name="t4", embedding_dim=4, num_embeddings=3,
                                                               feature_names=["a"])])
    with pytest.raises(IndexError, match="feature 'd': id 7 is out of range"):
        ti.EmbeddingBagCollection(TABLES)(KeyedJaggedTensor.from_lengths_sync(
            ["a", "b", "c", "d"], torch.tensor([1, 2, 3, 7]), torch.ones(4, dtype=torch.long)))



MALFORMED = {  # (lengths key-major: keys a, b, c, d over 2 rows; how many values): what each KJT is refused for
    "too many values": ([1, 1, 1, 1, 0, 0, 1, 1], 7, r"KeyedJaggedTensor lengths sum to 6 but it holds 7 values: the "
                                                    r"1 after key 'd' \(the last\) would be dropped"),
    "a negative length": ([1, 1, 0, 0, 1, -1, 1, 1], 4, r"KeyedJaggedTensor key 'c': row 1 has length -1; lengths "
                                                       r"must be >= 0"),
    "too few values": ([1, 1, 2, 2, 0, 0, 1, 1], 5, r"KeyedJaggedTensor key 'b': its lengths reach id 6 but it holds "
                                                   r"5 values"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_kjt_is_refused_at_the_edge_naming_its_key(case):
    lengths, count, message = MALFORMED[case]
    kjt = KeyedJaggedTensor(keys=["a", "b", "c", "d"], values=torch.arange(count) % 5, lengths=torch.tensor(lengths))
    ebc = ti.EmbeddingBagCollection(TABLES)  # two collections (dims 4 and 8): the KJT is checked before either
    with pytest.raises(ConfigError, match="EmbeddingCollection: " + message):
        ebc(kjt)
    with pytest.raises(ConfigError, match="from_kjt: " + message):
        ti.from_kjt(kjt)
    good = KeyedJaggedTensor(keys=["a", "b", "c", "d"], values=torch.arange(8) % 5,
                             lengths=torch.ones(8, dtype=torch.long))
    assert ebc(good).values().shape == (2, 20)  # a well-formed one passes: a, b, d of dim 4 and c of dim 8


# -- a TorchRec model trained through deeprec ----------------------------------------------------------
class NativeClick(nn.Module):
    """The example's model on deeprec's own input: ids dict -> EmbeddingCollection -> the same arches."""

    def __init__(self, twin):
        super().__init__()
        self.dense, self.sparse, self.label, self.buckets = twin.dense, twin.sparse, twin.label, twin.num_buckets
        self.collection = EmbeddingCollection([EmbeddingFeature(c, self.buckets) for c in self.sparse],
                                              twin.model.ebc.collections[0].embedding_dim)
        self.dense_arch, self.over_arch = twin.model.dense_arch, twin.model.over_arch  # replaced by copies below

    def forward(self, batch):
        dense = torch.stack([batch[c] for c in self.dense], 1).nan_to_num(0.0).clamp(min=0.0).log1p()
        ids = ops.string_to_hash_bucket([batch[c] for c in self.sparse], self.buckets)
        pooled = self.collection(dict(zip(self.sparse, ids))).flatten(1)
        logits = self.over_arch(torch.cat([self.dense_arch(dense), pooled], 1)).squeeze(1)
        return {"loss": nn.functional.binary_cross_entropy_with_logits(logits, batch[self.label]), "logits": logits}


def _twins(schema):
    import copy

    torch.manual_seed(0)
    torchrec_style = _example().ClickModel(schema, dim=8, num_embeddings=1000)
    native = NativeClick(torchrec_style)
    native.dense_arch, native.over_arch = copy.deepcopy(native.dense_arch), copy.deepcopy(native.over_arch)
    native.collection.lookup.weight.data.copy_(torchrec_style.model.ebc.collections[0].lookup.weight.data)
    return torchrec_style, native


GRAPH_CONFIGS = {"smart_stage": dict(smart_stage=True),
                 "smart_stage+micro_batch": dict(smart_stage=True, micro_batch_num=2),
                 "multi_stream": dict(multi_stream=dr.MultiStreamOptions(num_streams=2, policy="embedding"))}


@pytest.mark.parametrize("config", GRAPH_CONFIGS)
def test_torchrec_model_through_graph_passes_equals_the_model_on_deeprec_input(sample, config):
    """Losses and weights bitwise equal, step by step; SmartStage runs hashing and the KJT ahead."""
    schema, batches = _batches(sample, 5)
    torchrec_style, native = _twins(schema)
    runs = []
    for model in (torchrec_style, native):
        optimizer = dr.optim.make_optimizer(model, "adagrad", lr=0.05)
        fast = dr.optimize(model, dr.Config(**GRAPH_CONFIGS[config]))
        losses = []
        for out in fast.iterate(batches):
            out["loss"].backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(out["loss"].item())
        runs.append((losses, fast))
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 5
    assert torch.equal(torchrec_style.model.ebc.collections[0].lookup.weight, native.collection.lookup.weight)
    assert torch.equal(torchrec_style.model.over_arch[0].weight, native.over_arch[0].weight)
    if config.startswith("smart_stage"):
        stage = runs[0][1].explain().split("main (")[0]
        assert all(op in stage for op in ("kjt_parts", "KeyedJaggedTensor", "kjt_bags", "prepare_bags")), stage


def test_a_batch_holding_a_kjt_runs_through_smart_stage(sample):
    """TorchRec's own pipeline: the KJT made outside, carried in the batch; the model unchanged."""
    example = _example()
    schema, batches = _batches(sample, 3)
    sparse = list(schema.of_kind("categorical"))
    torchrec_batches = [{"dense": torch.stack([b[f"I{i}"] for i in range(1, 14)], 1).nan_to_num(0.0).clamp(min=0.0)
                         .log1p(), "sparse": ti.to_kjt(b, sparse, num_buckets=1000), "label": b["label"]}
                        for b in batches]

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = example.SparseNN(ti.EmbeddingBagCollection(example.tables_for(sparse, 8, 1000)), 13)

        def forward(self, batch):
            logits = self.model(batch["dense"], batch["sparse"])
            return {"loss": nn.functional.binary_cross_entropy_with_logits(logits, batch["label"]), "logits": logits}

    model = Head()
    fast = dr.optimize(model, dr.Config(smart_stage=True))
    assert "kjt_bags" in fast.explain().split("main (")[0]
    with torch.no_grad():
        got = [out["loss"] for out in fast.iterate(torchrec_batches)]
        want = [model(b)["loss"] for b in torchrec_batches]
    assert torch.equal(torch.stack(got), torch.stack(want))


def test_torchrec_model_in_the_trainer_equals_the_model_on_deeprec_input(sample):
    """deeprec's Trainer (reader, SmartStage, row-sparse Adagrad): the same final weights."""
    from deeprec.trainer import TrainConfig, Trainer

    schema = resolve_schema([sample])
    torchrec_style, native = _twins(schema)
    common = dict(data=[sample], steps=6, batch_size=32, progress=False, optimize={"smart_stage": True})
    results = [Trainer(TrainConfig.create(**common), model=m).train() for m in (torchrec_style, native)]
    assert results[0]["final_loss"] == results[1]["final_loss"]
    assert torch.equal(torchrec_style.model.ebc.collections[0].lookup.weight, native.collection.lookup.weight)


@pytest.mark.slow
@pytest.mark.parametrize("embedding_variables", [False, True])
@pytest.mark.filterwarnings("ignore:.*scoring with the ExportedProgram")
def test_torchrec_model_exports_and_serves_its_scores(tmp_path, sample, embedding_variables):
    """torch.export captures the KJT made inside forward; the served scores are the model's."""
    from deeprec.serving import load
    from deeprec.serving.export import export

    schema, batches = _batches(sample, 3, batch_size=16)
    model = _example().ClickModel(schema, dim=8, num_embeddings=1000, embedding_variables=embedding_variables)
    optimizer = dr.optim.make_optimizer(model, "adagrad", lr=0.05)
    for batch in batches[:2]:
        model(batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    export(model, str(tmp_path / "exp"), schema=schema, compile=False, progress=False)
    with torch.no_grad():
        model.eval()
        want = torch.sigmoid(model(batches[2])["logits"])
    torch.testing.assert_close(load(str(tmp_path / "exp"))(batches[2]), want, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_torchrec_model_on_embedding_variables_trains_on_a_ps_as_locally(ps_pool, sample):
    from deeprec.distributed.ps.strategy import ParameterServer
    from deeprec.trainer import TrainConfig, Trainer

    schema = resolve_schema([sample])
    example = _example()
    common = dict(data=[sample], steps=5, batch_size=32, optimizer="sgd", lr=0.1, progress=False,
                  optimize={"smart_stage": True})
    torch.manual_seed(0)
    local = Trainer(TrainConfig.create(**common), model=example.ClickModelEV(schema, dim=8))
    torch.manual_seed(0)
    addresses, _ = ps_pool(1)
    remote = Trainer(TrainConfig.create(**common), model=example.ClickModelEV(schema, dim=8),
                     strategy=ParameterServer(addresses))
    want, got = local.train(), remote.train()
    assert got["final_loss"] == pytest.approx(want["final_loss"], rel=1e-5)
    rows = remote.updater.client.snapshot()
    name = next(k for k in rows if k.endswith("C1/keys"))
    keys, values = rows[name], rows[name.replace("/keys", "/values")]
    ev = local.model.model.ebc.collections[0].lookup.variables[0]
    want_keys, want_values = ev.snapshot()
    order, want_order = torch.argsort(keys), torch.argsort(want_keys)
    assert torch.equal(keys[order], want_keys[want_order])
    torch.testing.assert_close(values[order], want_values[want_order], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_torchrec_model_trains_collectively(tmp_path, sample):
    done = subprocess.run([sys.executable, "-m", "deeprec.cli", "launch", "--workers", "2", "--collective", "--",
                           "train", "--model", f"{EXAMPLE}:ClickModel", "--data", sample, "--steps", "4",
                           "--batch-size", "16", "--checkpoint-dir", str(tmp_path / "ck")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2/2 workers succeeded" in done.stdout and "all-to-all per step" in done.stdout
