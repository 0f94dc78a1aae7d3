"""One call where the step makes the same pure op call twice (common subexpression elimination).

    ids ──prepare_bags(ids, ...)──> bags_a ──> lookup A          ids ──prepare_bags(ids, ...)──> bags ─┬─> lookup A
        └─prepare_bags(ids, ...)──> bags_b ──> lookup B    ==>                                         └─> lookup B

A model written plainly repeats work its parts share: Wide & Deep and DeepFM embed the same hashed ids
in two FeatureEmbedders (the deep and the wide/FM part), each laying out the same bags, ~0.3 ms a batch
on 2 cores. Only ops declared pure (`@op(pure=True)`: the result depends on the arguments alone, no
state, no random numbers; deeprec's hashing, bucketizing, dedup and bag ops) are merged, where their
arguments are the same nodes and equal plain constants (no tensor constant), and only in a graph with no
node that may write a tensor in place (a method or function ending in `_`, `inplace=True`, `out=`, a module
with `inplace` set, a user module other than deeprec's embedding lookups, which only read their inputs, a
deeprec op not declared pure, any function from outside torch and Python's operators): the merged call
then computes what each call did, and the step the same bits. It changes only a graph that runs (SmartStage,
bf16, multi-stream, `--compile`); without them the model runs as written.
"""
from __future__ import annotations

import operator

import torch.fx

from deeprec.nn.lookup import EmbeddingLookup
from deeprec.ops.graph_op import is_op, is_pure_op

_PLAIN = (int, bool, str, type(None), torch.dtype, torch.device)


def _key(node: torch.fx.Node):
    """A hashable form of the call (target, args, kwargs), or None where an argument is not a node or
    a plain constant."""
    def freeze(value):
        if isinstance(value, torch.fx.Node):
            return ("node", value)
        if isinstance(value, (list, tuple)):
            items = tuple(freeze(v) for v in value)
            return None if None in items else (type(value).__name__, items)
        if isinstance(value, dict):
            items = tuple((k, freeze(v)) for k, v in value.items())
            return None if any(v is None for _, v in items) else ("dict", items)
        if isinstance(value, float):
            return ("float", repr(value))  # 0.0 and -0.0 differ; nan never equals itself
        return ("const", type(value).__name__, value) if isinstance(value, _PLAIN) else None

    args, kwargs = freeze(node.args), freeze(node.kwargs)
    return None if args is None or kwargs is None else (node.target, args, kwargs)


_LIBRARIES = ("torch", "_operator", "operator", "builtins", "math")  # functions known not to write but by name


def _may_write_in_place(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    if node.op in ("placeholder", "output", "get_attr"):
        return False
    if "out" in node.kwargs or node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method":
        return str(node.target).endswith("_")
    if node.op == "call_function":
        target = node.target
        if is_op(target):  # a deeprec op: only those declared pure are known to write nothing
            return not is_pure_op(target)
        name = getattr(getattr(target, "overloadpacket", target), "__name__", "")  # aten.add_.Tensor: add_
        module = getattr(target, "__module__", None) or ""
        return name.endswith("_") or target is operator.setitem or not module.split(".")[0] in _LIBRARIES
    module = gm.get_submodule(node.target)  # call_module
    if isinstance(module, EmbeddingLookup):
        return False
    return getattr(module, "inplace", False) is True or not type(module).__module__.startswith("torch.nn")


def merge_shared_calls(gm: torch.fx.GraphModule) -> int:
    """In place: each repeated call of a pure op is replaced by its first (and the items taken from its
    tuple result by the first's). Returns how many calls were merged."""
    if any(_may_write_in_place(node, gm) for node in gm.graph.nodes):
        return 0
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    first: dict = {}
    merged = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not is_pure_op(node.target):
            continue
        key = _key(node)
        if key is None:
            continue
        earlier = first.setdefault(key, node)
        if earlier is node:
            continue
        node.replace_all_uses_with(earlier)
        gm.graph.erase_node(node)
        merged += 1
        # the items it gave now repeat the first call's: one node each, the first in graph order
        taken = {}
        for user in sorted(earlier.users, key=position.__getitem__):
            if (user.op == "call_function" and user.target is operator.getitem and not user.kwargs
                    and len(user.args) == 2 and type(user.args[1]) is int):
                kept = taken.setdefault(user.args[1], user)
                if kept is not user:
                    user.replace_all_uses_with(kept)
                    gm.graph.erase_node(user)
    if merged:
        gm.graph.lint()
        gm.recompile()
    return merged
