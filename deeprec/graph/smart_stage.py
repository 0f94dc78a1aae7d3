"""The SmartStage pass: find the data-side subgraph of `forward` and split it off.

    batch ──> [stage: getitem, hash, fill, log, ... ] ──cut tensors──> [main: embeddings, MLPs, loss]

The stage region is every node reachable from the batch that is not downstream
of a parameter or buffer, a stateful or random op, or a `mark_target_node`.
With `dr.staged(...)` in forward, everything upstream of it is staged too (with
smart_stage=False, only that). The split itself is torch.fx's `split_module`;
its top-level graph is then cut in two at the main submodule's call.
The input graph module is left untouched.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.split_module import split_module

from deeprec.errors import ConfigError
from deeprec.graph.markers import mark_target_node, staged
from deeprec.nn.lookup import EmbeddingLookup
from deeprec.ops.graph_op import is_stateful_op

STAGE, MAIN = 0, 1
_NAME_KEY = "deeprec_original_name"

# Moving these into a background thread would reorder draws from the global RNG.
RANDOM_FUNCTIONS = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.bernoulli,
                    torch.multinomial, torch.normal, torch.poisson, torch.rand_like, torch.randn_like,
                    torch.randint_like, torch.dropout, F.dropout, F.dropout1d, F.dropout2d,
                    F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, F.gumbel_softmax}
RANDOM_METHODS = {"bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_",
                  "geometric_", "cauchy_", "log_normal_", "multinomial"}


@dataclass
class StagePartition:
    """Result of the pass: the two halves and what went where, and why."""

    stage: torch.fx.GraphModule | None  # batch -> tuple of cut values (None: nothing to stage)
    main: torch.fx.GraphModule  # *cut values -> forward's output
    stage_nodes: list[str]
    main_nodes: list[str]
    cut: list[str]  # values crossing from stage to main, deduplicated, in main's argument order
    kept: dict[str, str] = field(default_factory=dict)  # data-side node left in main -> reason
    manual: bool = False  # a dr.staged boundary was present


def _origin_reason(node: torch.fx.Node, root: nn.Module) -> str | None:
    """Why this node itself may not be staged, or None."""
    if node.op == "get_attr":
        return f"depends on parameter/buffer {node.target}"
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        if isinstance(module, EmbeddingLookup) and module.stateful:  # state outside parameters/buffers
            return f"stateful module {node.target} ({type(module).__name__})"
        for pname, _ in module.named_parameters():
            return f"depends on parameter {node.target}.{pname}"
        for bname, _ in module.named_buffers():
            return f"depends on buffer {node.target}.{bname}"
        if isinstance(module, nn.modules.dropout._DropoutNd):
            return f"random op {node.target} (staging would reorder the random stream)"
    if node.op == "call_function":
        if node.target is mark_target_node:
            return f"target-marked ({node.name})"
        if is_stateful_op(node.target):
            return f"stateful op {getattr(node.target, '__name__', node.target)}"
        if node.target in RANDOM_FUNCTIONS:
            return f"random op {getattr(node.target, '__name__', node.target)} (staging would reorder the random stream)"
    if node.op == "call_method" and node.target in RANDOM_METHODS:
        return f"random op .{node.target}() (staging would reorder the random stream)"
    return None


def _ancestors(nodes, include_self=True) -> set:
    seen, todo = set(), list(nodes)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(node.all_input_nodes)
    return seen if include_self else seen - set(nodes)


def find_stage_region(gm: torch.fx.GraphModule, smart_stage: bool = True):
    """(stage nodes, {data-side node kept in main: reason}, manual boundary present)."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if not placeholders:
        raise ConfigError("forward takes no batch argument: nothing to stage")
    batch = placeholders[0]
    tainted: dict[torch.fx.Node, str] = {p: f"depends on argument {p.target}" for p in placeholders[1:]}
    reachable = {batch}
    for node in nodes:
        if node.op in ("placeholder", "output"):
            continue
        reason = _origin_reason(node, gm)
        if reason is None:
            reason = next((tainted[i] for i in node.all_input_nodes if i in tainted), None)
        if reason is not None:
            tainted[node] = reason
        if any(i in reachable for i in node.all_input_nodes):
            reachable.add(node)

    manual_marks = [n for n in nodes if n.op == "call_function" and n.target is staged]
    region: set = set()
    if manual_marks:
        region = _ancestors(manual_marks) - {batch}
        bad = [n for n in region if n in tainted]
        if bad:
            raise ConfigError(f"dr.staged(...) at node {manual_marks[0].name} depends on {bad[0].name}, "
                              f"which {tainted[bad[0]]}: staging it would compute with stale state")
    if smart_stage:
        auto = {n for n in reachable if n not in tainted and n.op not in ("placeholder", "output")}
        region |= auto
    # free helpers the region needs (e.g. a constant made in forward) come along
    region |= {n for n in _ancestors(region) if n.op not in ("placeholder",)}
    assert not any(n in tainted for n in region)
    kept = {n.name: tainted[n] for n in nodes if n in reachable and n in tainted and n.op != "placeholder"}
    return region, kept, bool(manual_marks)


def _cut_top_graph(split: torch.fx.GraphModule, boundary: torch.fx.Node):
    """Cut split_module's top-level graph before `boundary` into two graph modules."""
    order = list(split.graph.nodes)
    cut_at = order.index(boundary)
    # parameters and buffers that split_module fetched at top level belong to the main side
    head = [n for n in order[:cut_at] if n.op != "get_attr"]
    tail = [n for n in order[:cut_at] if n.op == "get_attr"] + order[cut_at:]
    tail_set = set(tail)
    crossing = [n for n in head if any(u in tail_set for u in n.users)]

    stage_graph, env = torch.fx.Graph(), {}
    for node in head:
        env[node] = stage_graph.node_copy(node, lambda n: env[n])
    stage_graph.output(tuple(env[n] for n in crossing))

    main_graph, env = torch.fx.Graph(), {}
    for node in crossing:
        env[node] = main_graph.placeholder(node.name)
    for node in tail:
        env[node] = main_graph.node_copy(node, lambda n: env[n])
    return (torch.fx.GraphModule(split, stage_graph, "Stage"),
            torch.fx.GraphModule(split, main_graph, "Main"), crossing)


def smart_stage_pass(gm: torch.fx.GraphModule, smart_stage: bool = True) -> StagePartition:
    """Split a captured forward into a background stage and the training step."""
    region, kept, manual = find_stage_region(gm, smart_stage)
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    stage_nodes = [n.name for n in compute if n in region]
    main_nodes = [n.name for n in compute if n not in region]
    if not stage_nodes:
        return StagePartition(None, gm, [], main_nodes, [], kept, manual)
    for node in gm.graph.nodes:  # split_module renames; remember the original names
        node.meta[_NAME_KEY] = node.name
    try:
        split = split_module(gm, gm, lambda node: STAGE if node in region else MAIN)
    finally:
        for node in gm.graph.nodes:
            node.meta.pop(_NAME_KEY, None)
    boundary = next((n for n in split.graph.nodes if n.op == "call_module" and n.target == f"submod_{MAIN}"),
                    next(n for n in split.graph.nodes if n.op == "output"))
    stage, main, crossing = _cut_top_graph(split, boundary)
    cut = _name_cut_values(split, crossing)
    return StagePartition(stage, main, stage_nodes, main_nodes, cut, kept, manual)


def _name_cut_values(split: torch.fx.GraphModule, crossing) -> list[str]:
    """The original graph's names of the values crossing the cut."""
    stage_sub = getattr(split, f"submod_{STAGE}", None)
    stage_out = next(n for n in stage_sub.graph.nodes if n.op == "output").args[0] if stage_sub else None

    def original(node: torch.fx.Node) -> str:
        return node.meta.get(_NAME_KEY, node.name)

    names = []
    for node in crossing:
        if node.op == "call_function" and node.args and getattr(node.args[0], "target", None) == f"submod_{STAGE}":
            names.append(original(stage_out[node.args[1]]))  # item k of the stage submodule's tuple
        elif node.op == "call_module" and node.target == f"submod_{STAGE}":
            names.append(original(stage_out) if isinstance(stage_out, torch.fx.Node) else node.name)
        else:
            names.append(original(node))
    return names
