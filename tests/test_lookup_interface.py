"""The EmbeddingLookup interface: passes and runtimes treat a PS lookup (RemoteLookup) and a
collective one (ShardedLookup) as they treat a local FusedLookup or EmbeddingVariable."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import deeprec as dr
from deeprec.distributed.ps.client import PSClient
from deeprec.distributed import Server
from deeprec.distributed.collective.sharded import ShardedLookup
from deeprec.distributed.collective.updater import shard_embeddings
from deeprec.distributed.ps.worker import PSUpdater, RemoteLookup, RemoteVariable
from deeprec.graph import capture
from deeprec.graph.multi_stream import multi_stream_pass
from deeprec.nn import EmbeddingLookup, FusedLookup
from deeprec.optim import make_optimizer
from deeprec.runtime.micro_batch import deferred_lookups


class TwoCollections(nn.Module):
    """Users' model: two EmbeddingCollections of EmbeddingVariables (ids already int), an MLP."""

    def __init__(self):
        super().__init__()
        self.user = dr.EmbeddingCollection([dr.nn.EmbeddingFeature("u")], 4)
        self.item = dr.EmbeddingCollection([dr.nn.EmbeddingFeature("i")], 4)
        self.mlp = nn.Linear(8, 1)

    def forward(self, batch):
        x = torch.cat([self.user({"u": batch["u"]}).flatten(1), self.item({"i": batch["i"]}).flatten(1)], 1)
        logit = self.mlp(x).squeeze(1)
        return {"loss": F.binary_cross_entropy_with_logits(logit, batch["label"]), "logits": logit}


def batch(rows=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"u": torch.randint(0, 12, (rows,), generator=g), "i": torch.randint(0, 12, (rows,), generator=g),
            "label": torch.randint(0, 2, (rows,), generator=g).float()}


@pytest.fixture
def one_rank(tmp_path):
    """torch.distributed with this process as the only rank (gloo): a real ShardedLookup's exchanges."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _as_remote(model):
    for c in (model.user, model.item):  # as PSUpdater swaps them (no server needed to classify)
        c.lookup = RemoteLookup(None, [f.name for f in c.lookup.features], c.lookup)


def _streams(model) -> list:
    gm = capture(model)
    multi_stream_pass(gm, dr.MultiStreamOptions(3, "embedding"))
    return [(n.name, n.meta["stream"]) for n in gm.graph.nodes if "stream" in n.meta]


def test_the_interface_is_abstract_and_every_lookup_implements_it():
    with pytest.raises(TypeError, match="abstract"):
        EmbeddingLookup()

    class NoUpdatePolicy(EmbeddingLookup):  # must say whether its backward updates rows
        def forward(self, ids):
            return ids

    with pytest.raises(TypeError, match="updates_in_backward"):
        NoUpdatePolicy()
    ev = dr.EmbeddingVariable(4)
    fused = TwoCollections().user.lookup
    for lookup in (ev, fused, RemoteLookup(None, ["u"], fused), RemoteVariable(None, "e", ev)):
        assert isinstance(lookup, EmbeddingLookup) and lookup.stateful


def test_multi_stream_and_smart_stage_treat_a_remote_and_a_sharded_lookup_like_a_local_one(one_rank):
    local = TwoCollections()
    make_optimizer(local)
    remote, sharded = copy.deepcopy(local), copy.deepcopy(local)
    _as_remote(remote)
    assert shard_embeddings(sharded) == 2
    assert isinstance(sharded.user.lookup, ShardedLookup) and isinstance(remote.user.lookup, RemoteLookup)
    expected = _streams(local)
    assert {s for name, s in expected if "lookup" in name} == {1, 2}  # a stream per lookup
    assert _streams(remote) == expected and _streams(sharded) == expected
    for model in (local, remote, sharded):
        kept = dr.optimize(model, dr.Config(smart_stage=True)).partition.kept
        assert kept["user_lookup"].startswith("stateful module user.lookup")  # never staged


def test_micro_batching_defers_the_lookups_that_update_in_backward(one_rank):
    local = TwoCollections()
    make_optimizer(local)
    remote, sharded = copy.deepcopy(local), copy.deepcopy(local)
    _as_remote(remote)
    shard_embeddings(sharded)
    assert all(isinstance(m, FusedLookup) for m in deferred_lookups(local)) and len(deferred_lookups(local)) == 2
    assert len(deferred_lookups(sharded)) == 2
    assert deferred_lookups(remote) == []  # its gradients always wait for the push (merged by take_gradients)
    assert dr.optimize(sharded, dr.Config()).collective and not dr.optimize(local, dr.Config()).collective


def _rows(ev, keys):
    ev.eval()
    return ev(keys)


def test_sharded_lookup_micro_batches_equal_the_local_full_batch(one_rank):
    torch.manual_seed(0)
    local = TwoCollections()
    sharded = copy.deepcopy(local)
    opt_local, opt_sharded = make_optimizer(local, "adagrad", 0.1), make_optimizer(sharded, "adagrad", 0.1)
    shard_embeddings(sharded)
    opt_sharded.lookups = [m for m in sharded.modules() if isinstance(m, ShardedLookup)]  # as CollectiveUpdater
    fast = dr.optimize(sharded, dr.Config(micro_batch_num=2))
    for seed in range(2):
        local(batch(seed=seed))["loss"].backward()
        fast.forward_backward(batch(seed=seed))
        for opt in (opt_local, opt_sharded):
            opt.step()
            opt.zero_grad()
    keys = torch.arange(12)
    for a, b in ((local.user, sharded.user), (local.item, sharded.item)):
        assert torch.allclose(_rows(a.lookup.variables[0], keys), _rows(b.lookup.variables[0], keys), atol=1e-6)


def test_remote_lookup_micro_batches_push_the_full_batch_update(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    server = Server({"ps": ["127.0.0.1:0"], "worker": ["w:1"]}, "ps", 0, protocol="star_server")
    client = PSClient([f"127.0.0.1:{server.port}"], deadline_s=20)
    try:
        torch.manual_seed(0)
        local = TwoCollections()
        remote = copy.deepcopy(local)
        opt_local = make_optimizer(local, "adagrad", 0.1)
        updater = PSUpdater(remote, client, "adagrad", 0.1)
        fast = dr.optimize(remote, dr.Config(micro_batch_num=2))
        for seed in range(2):
            local(batch(seed=seed))["loss"].backward()
            opt_local.step()
            opt_local.zero_grad()
            updater.before_step()
            fast.forward_backward(batch(seed=seed))
            updater.apply()
        keys = torch.arange(12)
        pulled = client.pull_rows(remote.user.lookup.names, [keys], train=False)
        assert torch.allclose(pulled, _rows(local.user.lookup.variables[0], keys), atol=1e-6)
    finally:
        client.close()
        server.stop(None)
