"""One call where the step makes the same pure op call twice (common subexpression elimination).

    ids ──prepare_bags(ids, ...)──> bags_a ──> lookup A          ids ──prepare_bags(ids, ...)──> bags ─┬─> lookup A
        └─prepare_bags(ids, ...)──> bags_b ──> lookup B    ==>                                         └─> lookup B

A model written plainly repeats work its parts share: Wide & Deep and DeepFM embed the same hashed ids
in two FeatureEmbedders (the deep and the wide/FM part), each laying out the same bags, ~0.3 ms a batch
on 2 cores. Only deeprec ops that are not stateful (`@op`: they read nothing but their arguments) are
merged, and only where their arguments are the same nodes and equal plain constants (no tensor
constant, whose equality would need its values) and no consumer writes an output in place (`x.add_`,
`x[i] = v`): the merged call computes what each call did, so the step's outputs are the same bits.
"""
from __future__ import annotations

import operator

import torch.fx

from deeprec.ops.graph_op import is_op, is_stateful_op

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


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
        return ("const", type(value).__name__, value) if isinstance(value, _PLAIN) else None

    args, kwargs = freeze(node.args), freeze(node.kwargs)
    return None if args is None or kwargs is None else (node.target, args, kwargs)


def _written_in_place(node: torch.fx.Node) -> bool:
    """Whether a consumer of `node` (or of an item of its tuple result) may write it in place."""
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem:
            if _written_in_place(user):
                return True
        elif user.op == "call_method" and str(user.target).endswith("_"):
            return True
        elif user.op == "call_function" and (user.target is operator.setitem or
                                             getattr(user.target, "__name__", "").endswith("_")):
            return True
    return False


def merge_shared_calls(gm: torch.fx.GraphModule) -> int:
    """In place: each repeated call of a pure deeprec op is replaced by its first (the items of a tuple
    result too). Returns how many calls were merged."""
    first: dict = {}
    merged = 0
    for node in list(gm.graph.nodes):
        pure_op = node.op == "call_function" and is_op(node.target) and not is_stateful_op(node.target)
        item = node.op == "call_function" and node.target is operator.getitem
        if not (pure_op or item):
            continue
        key = _key(node)
        if key is None:
            continue
        earlier = first.setdefault(key, node)
        if earlier is node or (pure_op and (_written_in_place(node) or _written_in_place(earlier))):
            continue
        node.replace_all_uses_with(earlier)
        gm.graph.erase_node(node)
        merged += pure_op
    if merged:
        gm.graph.lint()
        gm.recompile()
    return merged
