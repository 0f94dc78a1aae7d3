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


def test_dlrm_interaction_equals_the_lower_triangle_of_bmm(real_batch, monkeypatch):
    """DLRM's pairwise dots come from one native op (deeprec.ops.step.dot_interaction): the model's
    logits and gradients equal those of the same model whose dots index the strict lower triangle of
    bmm(x, x^T), to float rounding (the op sums each dot in order, MKL's bmm in its own)."""
    import deeprec.models.dlrm as dlrm

    def plain(x):
        rows, cols = torch.tril_indices(x.shape[1], x.shape[1], offset=-1)
        return torch.bmm(x, x.transpose(1, 2))[:, rows, cols]

    results = []
    for interaction in (dlrm.dot_interaction, plain):
        monkeypatch.setattr(dlrm, "dot_interaction", interaction)
        torch.manual_seed(0)
        model = build_model("dlrm", embedding="table")
        out = model(real_batch)
        out["loss"].backward()
        results.append((out["logits"].detach(), {n: p.grad for n, p in model.named_parameters() if n.startswith("bottom")}))
    (ours, our_grads), (theirs, their_grads) = results
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, their_grads[name], rtol=1e-4, atol=1e-6)
