import pytest
import torch
import torch.fx

from deeprec.graph import capture

from deeprec.data import CriteoReader
from deeprec.models import DLRMConfig, build_model

CRITEO_MODELS = ("dlrm", "deepfm", "wdl")  # the behaviour models: tests/test_behavior_models.py
from deeprec.errors import ConfigError
from deeprec.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def real_batch(sample):
    return next(iter(CriteoReader(sample, 128)))


@pytest.mark.parametrize("name", CRITEO_MODELS)
def test_forward_backward_on_real_sample(name, real_batch):
    torch.manual_seed(0)
    model = build_model(name, embedding="table")  # hashed tables: a sparse gradient without an optimizer
    out = model(real_batch)
    assert set(out) == {"loss", "logits"}
    assert out["logits"].shape == (128,) and out["loss"].dim() == 0 and torch.isfinite(out["loss"])
    out["loss"].backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname  # the fused tables' weight too (sparse, see below)
    emb = model.embeddings.collection.lookup.weight.grad  # no optimizer attached: a sparse gradient
    assert emb.is_sparse  # only looked-up rows carry gradient
    touched = emb.coalesce().indices().unique()
    assert 0 < touched.numel() <= 128 * 26


@pytest.mark.parametrize("name", CRITEO_MODELS)
def test_fx_trace_gives_identical_outputs(name, real_batch):
    model = build_model(name)
    traced = capture(model)  # torch.fx, with the fused lookup as one node
    a, b = model(real_batch), traced(real_batch)
    assert torch.equal(a["logits"], b["logits"]) and torch.equal(a["loss"], b["loss"])


def test_default_sizes_follow_deeprec_modelzoo():
    dlrm = build_model("dlrm", embedding="table")
    assert build_model("dlrm").embeddings.kind == "variable"  # the zoo's default: EmbeddingVariables
    assert [m.out_features for m in dlrm.bottom if isinstance(m, torch.nn.Linear)] == [512, 256, 64, 16]
    assert [m.out_features for m in dlrm.top if isinstance(m, torch.nn.Linear)] == [512, 256, 1]
    assert dlrm.embeddings.collection.names == [f"C{i}" for i in range(1, 27)]
    assert dlrm.embeddings.collection.lookup.weight.shape == (26 * 10000, 16)  # 26 tables of 10k rows, fused
    assert len(build_model("dlrm", embedding="torch").embeddings.tables) == 26
    assert [m.out_features for m in build_model("deepfm").dnn if isinstance(m, torch.nn.Linear)] == [1024, 256, 32, 1]
    assert [m.out_features for m in build_model("wdl").dnn if isinstance(m, torch.nn.Linear)] == [1024, 512, 256, 1]


def test_sizes_are_configurable_and_checked():
    small = build_model("dlrm", embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(16,), hash_buckets=[50] * 26,
                        embedding="table")
    assert small.embeddings.collection.lookup.weight.shape == (26 * 50, 8)
    with pytest.raises(ConfigError, match="embedding='hash' is not allowed"):
        build_model("dlrm", embedding="hash")
    with pytest.raises(ValueError, match="bottom_mlp must end at embedding_dim=16"):
        DLRMConfig(bottom_mlp=(64, 32))
    with pytest.raises(ValueError, match="25 entries for 26"):
        build_model("dlrm", hash_buckets=[10] * 25)
    with pytest.raises(ConfigError, match="model='dcn' is not allowed"):
        build_model("dcn")


@pytest.mark.slow
@pytest.mark.parametrize("name", CRITEO_MODELS)
def test_learns_planted_click_model(name, synthetic):
    train_file, eval_file = synthetic
    result = train(TrainConfig.create(model=name, data=[train_file], eval_data=[eval_file], steps=150,
                               batch_size=512, progress=False))
    assert result["steps"] == 150
    assert result["eval"]["rows"] == 10_000
    assert result["eval"]["auc"] > 0.7, result["eval"]


def test_dlrm_interaction_pairs_equal_the_lower_triangle_with_its_gradient():
    """DLRM picks the pairwise dots by index_select over the flattened [n, n] matrix (its backward an
    index_add): the same values and gradients as indexing the strict lower triangle."""
    from deeprec.models import DLRM

    model = DLRM()
    n = int(round(model.pairs.numel() * 2) ** 0.5) + 1
    rows, cols = torch.tril_indices(n, n, offset=-1)
    vectors = torch.randn(64, n, 16, requires_grad=True)
    twin = vectors.detach().clone().requires_grad_()
    ours = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1).index_select(1, model.pairs)
    plain = torch.bmm(twin, twin.transpose(1, 2))[:, rows, cols]
    assert torch.equal(ours, plain)
    grad = torch.randn_like(ours)
    ours.backward(grad)
    plain.backward(grad)
    assert torch.equal(vectors.grad, twin.grad)
