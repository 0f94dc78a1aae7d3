"""Users' own models (tests/custom_models.py, and examples/custom_model.py) through every pass of
`dr.optimize`: each lookup is one graph node, SmartStage stages the hashing but never a lookup, and
loss, dense gradients and the rows after an optimizer step equal eager (bitwise where the pass
promises it, 1e-6 for micro-batching, bf16 against eager autocast)."""
from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch
from torch import nn

import custom_models as cm
import deeprec as dr
from deeprec.cli import sample_path
from deeprec.data import open_reader, resolve_schema
from deeprec.nn import EmbeddingLookup
from deeprec.optim import make_optimizer

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "custom_model.py")


def _example_model():
    spec = importlib.util.spec_from_file_location("custom_model_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ClickModel(resolve_schema([sample_path()], None), dim=4)


# name -> (model factory, lookup nodes expected in the graph: deeprec lookups + torch embeddings)
MODELS = {
    "ev_alone": (cm.EVAlone, 1), "ev_module_list": (cm.EVList, 4), "shared_embedding": (cm.SharedEmbedding, 2),
    "two_tower": (cm.TwoTower, 3), "wide_and_deep": (cm.WideAndDeep, 3), "multi_task": (cm.MultiTask, 3),
    "own_op": (cm.OwnOpModel, 2), "hashed_torch_embeddings": (cm.HashedTorchEmbeddings, 2),
    "embedding_collection": (cm.CollectionModel, 1), "sequence_attention": (cm.SequenceAttention, 3),
    "example_module_dict": (_example_model, 26), "shared_names": (cm.SharedNames, 2),
    "mixed_embeddings": (cm.MixedEmbeddings, 5),
}


@pytest.fixture(scope="module")
def criteo_batches():
    schema = resolve_schema([sample_path()], None)
    reader = iter(open_reader([sample_path()], 24, schema=schema))
    return [next(reader) for _ in range(2)]


def batches_for(name: str, criteo_batches) -> list:
    return [cm.behavior_batch(seed=s) for s in range(2)] if name == "sequence_attention" else criteo_batches


def _lookup_nodes(fast) -> list:
    gm = fast.graph_module
    return [n for n in gm.graph.nodes if n.op == "call_module"
            and isinstance(gm.get_submodule(n.target), (EmbeddingLookup, nn.Embedding, nn.EmbeddingBag))]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_lookup_is_one_node_and_smart_stage_stages_only_the_hashing(name, criteo_batches):
    make, expected = MODELS[name]
    model = make()
    fast = dr.optimize(model, dr.Config(smart_stage=True))
    lookups = _lookup_nodes(fast)
    assert len(lookups) == expected
    assert not any(n.target is torch.unique for n in fast.graph_module.graph.nodes)  # never traced into an EV
    stage = set(fast.partition.stage_nodes)
    assert not stage & {n.name for n in lookups}  # stateful (or holding parameters): never staged
    hashing = [n.name for n in fast.graph_module.graph.nodes if "hash" in getattr(n.target, "__name__", "")]
    assert hashing and set(hashing) <= stage or name == "sequence_attention"  # int ids: nothing to hash
    model.eval()  # the captured graph computes what forward does (eval: no key inserted)
    batch = batches_for(name, criteo_batches)[0]
    assert torch.equal(fast.graph_module(batch)["logits"], model(batch)["logits"])


def _variables(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, dr.EmbeddingVariable)]


def _rows_by_key(ev) -> tuple[torch.Tensor, torch.Tensor]:
    keys, values = ev.snapshot()
    order = keys.argsort()
    return keys[order], values[order]


def _assert_close(a: torch.Tensor, b: torch.Tensor, exact: bool, what: str, tol: float = 1e-6) -> None:
    a, b = a.to_dense() if a.is_sparse else a, b.to_dense() if b.is_sparse else b
    if exact:
        assert torch.equal(a, b), what
    else:  # relative to the tensor's scale, as tests/test_graph_opts.py compares micro-batches
        assert (a.float() - b.float()).abs().max() <= tol * max(b.float().abs().max(), 1.0), what


def train_and_compare(make, batches, config: dr.Config, exact: bool, tol: float = 1e-6, autocast: bool = False):
    """Two identical copies: one eager, one through dr.optimize(config); a step on each batch; outputs,
    dense gradients, then the parameters and EmbeddingVariable rows after each optimizer step compared."""
    torch.manual_seed(0)
    eager = make()
    twin = copy.deepcopy(eager)
    opt_eager, opt_twin = make_optimizer(eager, "adagrad", 0.05), make_optimizer(twin, "adagrad", 0.05)
    fast = dr.optimize(twin, config)
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ref = eager(batch)
        ref["loss"].backward()
        out = fast.forward_backward(batch)
        _assert_close(out["loss"], ref["loss"].detach(), exact, "loss", tol)
        _assert_close(out["logits"], ref["logits"].detach(), exact, "logits", tol)
        for (name, p), q in zip(eager.named_parameters(), twin.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                _assert_close(q.grad, p.grad, exact, f"gradient of {name}", tol)
        for opt in (opt_eager, opt_twin):
            opt.step()
            opt.zero_grad()
        for (name, p), q in zip(eager.named_parameters(), twin.parameters()):  # fixed tables' rows too
            _assert_close(q.detach(), p.detach(), exact, name, tol)
        for a, b in zip(_variables(eager), _variables(twin)):  # rows compared by key: insert order may differ
            keys_a, rows_a = _rows_by_key(a)
            keys_b, rows_b = _rows_by_key(b)
            assert torch.equal(keys_a, keys_b) and keys_a.numel() > 0, a.name
            _assert_close(rows_b, rows_a, exact, f"rows of {a.name}", tol)
    return fast


EXACT_CONFIGS = {"plain": dr.Config(), "smart_stage": dr.Config(smart_stage=True),
                 "multi_stream": dr.Config(multi_stream=dr.MultiStreamOptions(2, "embedding")),
                 "smart_stage_multi_stream": dr.Config(smart_stage=True,
                                                       multi_stream=dr.MultiStreamOptions(2, "embedding"))}


@pytest.mark.parametrize("config", sorted(EXACT_CONFIGS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_passes_that_keep_the_math_bitwise(name, config, criteo_batches):
    train_and_compare(MODELS[name][0], batches_for(name, criteo_batches), EXACT_CONFIGS[config], exact=True)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_micro_batches_equal_the_full_batch(name, criteo_batches):
    """Free EmbeddingVariables keep their rows' gradients over the micro-batches too: every micro-batch
    reads the step's rows, and one merged update runs at the optimizer step."""
    train_and_compare(MODELS[name][0], batches_for(name, criteo_batches), dr.Config(micro_batch_num=2),
                      exact=False)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_equals_eager_autocast(name, criteo_batches):
    """bf16=True runs the step under torch.autocast(bfloat16), weights fp32: exactly what eager
    computes under autocast (the same ops, in the same order)."""
    train_and_compare(MODELS[name][0], batches_for(name, criteo_batches), dr.Config(bf16=True), exact=True,
                      autocast=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ev_module_list", "shared_embedding", "embedding_collection", "sequence_attention"])
def test_graph_fusion_equals_eager(name, criteo_batches):
    fast = train_and_compare(MODELS[name][0], batches_for(name, criteo_batches), dr.Config(graph_fusion=True),
                             exact=False, tol=1e-5)
    assert fast.main_step.compiled.failed is None  # compiled, not the eager fallback


def test_multi_stream_embedding_policy_gives_each_lookup_a_stream(criteo_batches):
    fast = dr.optimize(cm.EVList(), dr.Config(multi_stream=dr.MultiStreamOptions(3, "embedding")))
    streams = [n.meta["stream"] for n in _lookup_nodes(fast)]
    assert streams == [1, 2, 0, 1]  # round-robin from stream 1: the dense side keeps stream 0
