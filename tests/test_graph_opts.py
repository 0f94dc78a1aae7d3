"""MultiStream, Auto Micro Batch, graph fusion and bf16: each keeps the math."""
import copy

import pytest
import torch
from torch import nn

import deeprec as dr
from deeprec.data import CriteoReader
from deeprec.graph import MultiStreamOptions, capture, colocate_with, minimum_chains, multi_stream_pass, stream
from deeprec.graph.multi_stream import STREAM_KEY
from deeprec.models import build_model
from deeprec.optim import make_optimizer


class TwoTowers(nn.Module):
    """Two independent towers over dense inputs, plus embeddings: a multi-branch model."""

    def __init__(self):
        super().__init__()
        self.user = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.item = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.emb_a, self.emb_b = nn.EmbeddingBag(50, 16, mode="sum"), nn.EmbeddingBag(50, 16, mode="mean")

    def forward(self, batch):
        with stream(0):
            u = self.user(batch["x"]) + self.emb_a(batch["ids"])
        with stream(1):
            i = self.item(batch["y"])
            with colocate_with(u):
                e = self.emb_b(batch["ids"]) * 2
        logits = (u * (i + e)).sum(1)
        return {"logits": logits, "loss": nn.functional.binary_cross_entropy_with_logits(logits, batch["label"])}


def towers_batch(seed=0, n=64):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 8, generator=g), "y": torch.randn(n, 8, generator=g),
            "ids": torch.randint(0, 50, (n, 3), generator=g), "label": torch.randint(0, 2, (n,), generator=g).float()}


def test_user_markers_and_colocate_set_the_streams():
    gm = multi_stream_pass(capture(TwoTowers()), MultiStreamOptions(2, "user"))
    streams = {n.name: n.meta[STREAM_KEY] for n in gm.graph.nodes if STREAM_KEY in n.meta}
    assert streams["user_0"] == 0 and streams["emb_a"] == 0
    assert streams["item_0"] == 1 and streams["item_2"] == 1
    assert streams["emb_b"] == 0 and streams["mul"] == 0  # colocated with u
    assert streams["add_1"] == 0  # after the with blocks: stream 0


def test_stream_id_beyond_num_streams_names_both_numbers():
    with pytest.raises(dr.ConfigError, match=r"dr.stream\(1\).*num_streams=1"):
        multi_stream_pass(capture(TwoTowers()), MultiStreamOptions(1, "user"))
    with pytest.raises(dr.ConfigError, match="policy"):
        MultiStreamOptions(2, "fastest")


def test_minimum_chains_cover_every_node_once():
    gm = capture(TwoTowers())
    chains = minimum_chains(gm.graph)
    covered = [n for chain in chains for n in chain]
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    assert sorted(n.name for n in covered) == sorted(n.name for n in compute)
    for chain in chains:  # consecutive nodes are edges of the graph
        assert all(b in a.users for a, b in zip(chain, chain[1:]))
    # a DAG whose widest antichain has w nodes needs at least w chains; here the
    # four getitems of the batch columns are pairwise independent
    assert len(chains) >= 4


@pytest.mark.parametrize("policy", ["user", "embedding", "full"])
def test_streams_keep_outputs_and_gradients(policy):
    torch.manual_seed(0)
    plain = TwoTowers()
    twin = copy.deepcopy(plain)
    fast = dr.optimize(twin, dr.Config(multi_stream=MultiStreamOptions(3, policy)))
    assert fast.main_step.streams.streams_used >= 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the stream threads run with cores // streams intra-op threads
    try:
        for seed in range(3):
            batch = towers_batch(seed)
            a, b = plain(batch), fast(batch)
            assert torch.equal(a["logits"], b["logits"])
            a["loss"].backward()
            b["loss"].backward()
        for (name, p), q in zip(plain.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad), name
    finally:
        torch.set_num_threads(threads)


def test_a_failing_stream_raises_in_the_caller():
    fast = dr.optimize(TwoTowers(), dr.Config(multi_stream=MultiStreamOptions(2, "user")))
    batch = towers_batch()
    batch["y"] = torch.randn(64, 7)  # item tower (stream 1) fails
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        fast(batch)
    assert fast(towers_batch())["logits"].shape == (64,)  # and the runner still works


def test_seed_two_stream_linear_regression_converges_to_the_same_weights():
    """The seed's best-practice example: Z = X*W_X + b (stream 0) + Y*W_Y (stream 1)."""
    X = torch.tensor([[3.3], [4.4], [5.5], [6.71], [6.93], [4.168], [9.779], [6.182], [7.59], [2.167],
                      [7.042], [10.791], [5.313], [7.997], [5.654], [9.27], [3.1]])
    Z = torch.tensor([[1.7], [2.76], [2.09], [3.19], [1.694], [1.573], [3.336], [2.596], [2.53], [1.221],
                      [2.827], [3.465], [1.65], [2.904], [2.42], [2.94], [1.3]])

    class Regression(nn.Module):
        def __init__(self):
            super().__init__()
            self.w_x, self.b, self.w_y = nn.Parameter(torch.tensor([[0.3]])), nn.Parameter(torch.zeros(1)), \
                nn.Parameter(torch.tensor([[-0.2]]))

        def forward(self, batch):
            with stream(0):
                x_result = batch["x"] @ self.w_x + self.b
            with stream(1):
                y_result = batch["y"] @ self.w_y
            z = x_result + y_result
            return {"loss": ((z - batch["z"]) ** 2).sum() / 17}

    plain = Regression()
    streamed = copy.deepcopy(plain)
    fast = dr.optimize(streamed, dr.Config(multi_stream=MultiStreamOptions(2, "user")))
    batch = {"x": X, "y": X.clone(), "z": Z}  # the seed's train_Y equals train_X
    start = plain(batch)["loss"].item()
    for model, step in ((plain, plain), (streamed, fast)):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(1000):  # the seed's max_train_steps
            step(batch)["loss"].backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(plain.parameters(), streamed.parameters()):
        assert torch.equal(p, q)
    assert fast(batch)["loss"].item() < start / 5  # it did converge


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("embedding", ["table", "variable", "torch"])
def test_micro_batches_give_the_full_batch_gradient(sample, n, embedding):
    torch.manual_seed(0)
    plain = build_model("dlrm", hash_buckets=500, embedding=embedding)
    twin = copy.deepcopy(plain)
    fast = dr.optimize(twin, dr.Config(micro_batch_num=n))
    opt_a, opt_b = make_optimizer(plain, "adagrad", 0.05), make_optimizer(twin, "adagrad", 0.05)
    batches = list(CriteoReader(sample, batch_size=64))  # 64 = 21 + 21 + 22 with n=3: uneven split
    for batch in batches[:2]:
        full = plain(batch)
        full["loss"].backward()
        grads = {k: p.grad.to_dense().clone() for k, p in plain.named_parameters() if p.grad is not None}
        opt_a.step()
        opt_a.zero_grad()
        out = fast.forward_backward(batch)
        assert torch.allclose(out["loss"], full["loss"].detach(), rtol=1e-6)
        assert torch.allclose(out["logits"], full["logits"].detach(), rtol=1e-5, atol=1e-6)
        for k, p in twin.named_parameters():
            if k in grads:
                g = p.grad.to_dense()
                assert (g - grads[k]).abs().max() <= 1e-6 * grads[k].abs().max() + 1e-9, k
        opt_b.step()
        opt_b.zero_grad()
    if embedding == "variable":  # micro-batches insert keys in another order: compare rows by key
        for ev_a, ev_b in zip(plain.embeddings.collection.lookup.variables, twin.embeddings.collection.lookup.variables):
            order_a, order_b = ev_a.keys[: ev_a.size].argsort(), ev_b.keys[: ev_b.size].argsort()
            assert torch.equal(ev_a.keys[order_a], ev_b.keys[order_b])
            assert torch.allclose(ev_a.weight[order_a], ev_b.weight[order_b], rtol=1e-5, atol=1e-6)
        return
    for (k, a), b in zip(plain.state_dict().items(), twin.state_dict().values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), k


def test_micro_batch_iterate_reads_each_batch_once_and_matches_step(sample):
    torch.manual_seed(0)
    plain = build_model("dlrm", hash_buckets=500, embedding="table")
    twin = copy.deepcopy(plain)
    cfg = dr.Config(smart_stage=True, micro_batch_num=4, main_threads=torch.get_num_threads())
    fast_step, fast_iter = dr.optimize(plain, dr.Config(micro_batch_num=4)), dr.optimize(twin, cfg)
    opt_a, opt_b = make_optimizer(plain, "sgd", 0.1), make_optimizer(twin, "sgd", 0.1)
    reads = []

    class CountingReader(CriteoReader):
        def __iter__(self):
            for batch in super().__iter__():
                reads.append(len(batch["label"]))
                yield batch

    reader = CountingReader(sample, batch_size=48)
    losses_a = []
    for batch in CriteoReader(sample, batch_size=48):
        losses_a.append(fast_step.forward_backward(batch)["loss"].item())
        opt_a.step()
        opt_a.zero_grad()
    losses_b = []
    for out in fast_iter.iterate(reader, backward=True):
        losses_b.append(out["loss"].item())
        opt_b.step()
        opt_b.zero_grad()
    assert losses_a == losses_b and len(losses_b) == 5 and reads == [48, 48, 48, 48, 8]
    state = fast_iter.last_source_state  # the position after the last batch trained on
    assert state["epoch"] == 0 and state["batches"] == 5


def test_micro_batch_larger_than_batch_is_a_clear_error():
    fast = dr.optimize(TwoTowers(), dr.Config(micro_batch_num=8))
    with pytest.raises(dr.ConfigError, match="micro_batch_num=8 is larger than the batch"):
        fast.forward_backward(towers_batch(n=4))


def test_bf16_runs_matmuls_in_bfloat16_with_fp32_weights(sample):
    model = build_model("dlrm", hash_buckets=500, embedding="table")
    fast = dr.optimize(model, dr.Config(bf16=True))
    batch = next(iter(CriteoReader(sample, batch_size=32)))
    seen = []
    model.top[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    out = fast(batch)
    out["loss"].backward()
    assert seen == [torch.bfloat16] and out["loss"].dtype == torch.float32
    assert model.top[0].weight.dtype == torch.float32 and model.top[0].weight.grad.dtype == torch.float32
    ref = model(batch)["loss"]
    assert abs(out["loss"].item() - ref.item()) < 0.02


@pytest.mark.slow
def test_graph_fusion_keeps_outputs_or_falls_back_with_one_warning(sample, recwarn, small_model):
    torch.manual_seed(0)
    plain = build_model("dlrm", **small_model)
    twin = copy.deepcopy(plain)
    fast = dr.optimize(twin, dr.Config(smart_stage=True, graph_fusion=True))
    batch = next(iter(CriteoReader(sample, batch_size=32)))
    a, b = plain(batch), fast(batch)
    assert torch.allclose(a["logits"], b["logits"], atol=1e-5)
    a["loss"].backward()
    b["loss"].backward()
    for (k, p), q in zip(plain.named_parameters(), twin.parameters()):
        if p.grad is not None:
            assert torch.allclose(p.grad.to_dense(), q.grad.to_dense(), atol=1e-5), k
    fast(batch)
    warnings = [w for w in recwarn if "graph_fusion" in str(w.message)]
    assert len(warnings) <= 1 and (fast.main_step.compiled.failed is None) == (not warnings)


def test_graph_fusion_and_multi_stream_are_exclusive():
    with pytest.raises(dr.ConfigError, match="graph_fusion and multi_stream"):
        dr.Config(graph_fusion=True, multi_stream=MultiStreamOptions(2, "full"))


def test_micro_batches_split_sequence_columns(behavior):
    """DIN on behaviour logs: Ragged histories are split by rows; the gradient is the full batch's."""
    from deeprec.data import PRESETS, CsvReader

    torch.manual_seed(0)
    plain = build_model("din", hash_buckets=3000, batch_norm=False, embedding="table")  # batch statistics differ per micro-batch
    twin = copy.deepcopy(plain)
    fast = dr.optimize(twin, dr.Config(micro_batch_num=3))
    batch = next(iter(CsvReader(behavior[0], PRESETS["behavior"], batch_size=100)))
    plain(batch)["loss"].backward()
    out = fast.forward_backward(batch)
    assert out["logits"].shape == (100,)
    for (name, p), q in zip(plain.named_parameters(), twin.parameters()):
        a, b = p.grad.to_dense(), q.grad.to_dense()
        assert (a - b).abs().max() <= 1e-5 * a.abs().max() + 1e-8, name
