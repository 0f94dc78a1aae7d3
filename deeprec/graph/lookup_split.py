"""The step split at its embedding lookups, so that the dense rest can be compiled.

    step graph                           after split_at_lookups
    ──────────                           ──────────────────────
    lookup(ids)    ─┐                    lookup(ids)                 (eager: keys, rows, updates)
    bottom MLP      │ one graph    ──>   dense_1(x, rows, ...)       (a GraphModule of tensors only)
    interaction     │                    [lookup_2(...) ; dense_3(...)]  where lookups come later
    top MLP, loss  ─┘

A lookup is a module with Python state (a key index, tiers, a PS client, a lock): torch.compile
traced into it and broke the graph at its lock, then recompiled at every growth of a variable
(its sizes are Python ints), so `--compile` gained nothing. After this pass the dense segments hold
no lookup, and inductor compiles each once; the lookups stay calls on the parent graph. (Without
SmartStage the batch's preprocessing, hashing ops included, runs in the first dense segment.)
Nodes keep their order (torch.fx `split_module`), so the outputs are those of the graph as
written. The pass changes no module: the segments hold the graph's own parameters.
"""
from __future__ import annotations

import torch.fx
from torch import nn
from torch.fx.passes.split_module import split_module

from deeprec.nn.lookup import EmbeddingLookup

DENSE_PREFIX = "dense_"
LOOKUP_PREFIX = "lookup_"
SEGMENTS_KEY = "deeprec_dense_segments"  # in the split graph module's meta: the names the pass gave


def _is_lookup(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """deeprec's lookups, and torch's embeddings with sparse gradients (inductor makes dense ones)."""
    if node.op != "call_module":
        return False
    module = gm.get_submodule(node.target)
    return isinstance(module, EmbeddingLookup) or (isinstance(module, (nn.Embedding, nn.EmbeddingBag))
                                                   and module.sparse)


def split_at_lookups(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` as segments in node order: `lookup_K` (the lookup calls of a run) and `dense_K` (the
    nodes between them). Each run of nodes of one kind is a segment; K counts segments. (A parameter
    the graph reads directly stays a read on the parent graph, passed in: split_module's way.)"""
    segment, kind, assigned = -1, None, {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if _is_lookup(gm, node) != kind:
            segment, kind = segment + 1, _is_lookup(gm, node)
        assigned[node.name] = segment
    lookup_segments = {assigned[n.name] for n in gm.graph.nodes if _is_lookup(gm, n)}
    split = split_module(gm, gm, lambda node: assigned[node.name], keep_original_order=True)
    dense = []
    for node in split.graph.nodes:  # submod_K -> dense_K / lookup_K: the names say what runs there
        if node.op == "call_module" and node.target.startswith("submod_"):
            index = int(node.target[len("submod_"):])
            name = f"{LOOKUP_PREFIX if index in lookup_segments else DENSE_PREFIX}{index}"
            while hasattr(split, name):  # a module of the model's own by that name
                name = f"_{name}"
            split.add_submodule(name, split.get_submodule(node.target))
            split.delete_submodule(node.target)
            node.target = name
            if index not in lookup_segments:
                dense.append(name)
    split.meta[SEGMENTS_KEY] = dense
    split.recompile()
    return split


def dense_segments(gm: torch.fx.GraphModule) -> dict[str, nn.Module]:
    """The dense segments of a graph split by `split_at_lookups`, by name."""
    return {name: gm.get_submodule(name) for name in gm.meta[SEGMENTS_KEY]}
