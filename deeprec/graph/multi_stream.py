"""MultiStream: markers for `forward` and the pass that gives every node a stream.

    with dr.stream(1):            # nodes traced here run on stream 1 (nestable)
        user = self.user_tower(x)
    with dr.colocate_with(user):  # same stream as `user`'s node
        z = user * 2

Policies (`dr.MultiStreamOptions(num_streams, policy)`):
    "user"       the markers decide; unmarked nodes run on stream 0
    "embedding"  each embedding lookup, with the nodes that only feed it and the
                 nodes that only consume it, gets a stream, round-robin from stream 1
                 (the dense side keeps stream 0)
    "full"       a minimum chain decomposition of the DAG (minimum path cover by
                 bipartite matching); chains go to the least-loaded stream
The pass writes `node.meta["stream"]`; it changes nothing else in the graph.
Outside tracing the markers do nothing, so the model runs unchanged in eager mode.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.fx
from torch import nn

from deeprec.errors import ConfigError
from deeprec.options import check_fields, option

POLICIES = ("none", "user", "embedding", "full")
STREAM_KEY = "stream"
_USER_KEY = "deeprec_user_stream"
_marks = threading.local()  # the stream in effect while tracing on this thread


@dataclass
class MultiStreamOptions:
    num_streams: int = option(2, "run independent branches of the step on N streams (CUDA) / threads (CPU)",
                              flag="--multi-stream", metavar="N", ge=1)
    policy: str = option("user", "how nodes get streams: dr.stream markers, one per embedding branch, or "
                         "minimum chains", flag="--stream-policy", choices=POLICIES)

    def __post_init__(self):
        check_fields(self, ("optimize", "multi_stream"))  # types, bounds, choices: as declared


def _stack() -> list:
    if not hasattr(_marks, "stack"):
        _marks.stack = []
    return _marks.stack


def current_stream() -> int | None:
    stack = _stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def stream(index: int):
    """Nodes created inside run on stream `index` (like `tf.stream(i)`); nestable."""
    if not isinstance(index, int) or index < 0:
        raise ConfigError(f"dr.stream(index): index must be an int >= 0, got {index!r}")
    _stack().append(index)
    try:
        yield
    finally:
        _stack().pop()


@contextlib.contextmanager
def colocate_with(value):
    """Nodes created inside run on the stream of `value`'s node (like `tf.colocate_with`)."""
    node = getattr(value, "node", None)
    index = node.meta.get(_USER_KEY, 0) if isinstance(node, torch.fx.Node) else current_stream()
    _stack().append(index if index is not None else 0)
    try:
        yield
    finally:
        _stack().pop()


def record_user_stream(node: torch.fx.Node) -> None:
    """Called by the capture tracer for each node it creates."""
    index = current_stream()
    if index is not None:
        node.meta[_USER_KEY] = index


def _is_lookup(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """deeprec's lookups (local, PS, collective alike) and torch's embedding layers."""
    if node.op != "call_module":
        return False
    from deeprec.nn.lookup import EmbeddingLookup  # deeprec.nn imports this module's markers

    return isinstance(gm.get_submodule(node.target), (EmbeddingLookup, nn.Embedding, nn.EmbeddingBag))


def _compute_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op not in ("placeholder", "output")]


def _embedding_streams(gm: torch.fx.GraphModule, num_streams: int) -> dict:
    nodes = _compute_nodes(gm.graph)
    lookups = [n for n in nodes if _is_lookup(gm, n)]
    assignment = {n: 0 for n in nodes}
    branch_of: dict = {}
    for i, lookup in enumerate(lookups):
        branch_of[lookup] = i
    # upstream: a node whose every user is in branch b joins b (walk in reverse order)
    for node in reversed(nodes):
        if node in branch_of or not node.users:
            continue
        users = {branch_of.get(u) for u in node.users}
        if len(users) == 1 and None not in users:
            branch_of[node] = users.pop()
    # downstream: a node whose every computed input is in branch b joins b
    for node in nodes:
        if node in branch_of:
            continue
        inputs = {branch_of.get(i) for i in node.all_input_nodes if i.op != "placeholder"}
        if len(inputs) == 1 and None not in inputs:
            branch_of[node] = inputs.pop()
    for node, branch in branch_of.items():
        assignment[node] = (branch + 1) % num_streams
    return assignment


def minimum_chains(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """Fewest vertex-disjoint paths covering the DAG's compute nodes (maximum bipartite matching)."""
    import networkx as nx  # here: 0.1 s of every process's start otherwise

    nodes = _compute_nodes(graph)
    index = {n: i for i, n in enumerate(nodes)}
    bipartite = nx.Graph()
    bipartite.add_nodes_from((("out", i) for i in range(len(nodes))), bipartite=0)
    bipartite.add_nodes_from((("in", i) for i in range(len(nodes))), bipartite=1)
    for n in nodes:
        for user in n.users:
            if user in index:
                bipartite.add_edge(("out", index[n]), ("in", index[user]))
    top = [("out", i) for i in range(len(nodes))]
    matching = nx.bipartite.hopcroft_karp_matching(bipartite, top_nodes=top)
    successor = {i: matching[("out", i)][1] for i in range(len(nodes)) if ("out", i) in matching}
    has_predecessor = set(successor.values())
    chains = []
    for start in range(len(nodes)):
        if start in has_predecessor:
            continue
        chain, i = [], start
        while i is not None:
            chain.append(nodes[i])
            i = successor.get(i)
        chains.append(chain)
    return chains


def _full_streams(gm: torch.fx.GraphModule, num_streams: int) -> dict:
    load = [0] * num_streams
    assignment = {}
    for chain in sorted(minimum_chains(gm.graph), key=len, reverse=True):
        target = min(range(num_streams), key=lambda s: (load[s], s))
        load[target] += len(chain)
        assignment.update({n: target for n in chain})
    return assignment


def multi_stream_pass(gm: torch.fx.GraphModule, options: MultiStreamOptions) -> torch.fx.GraphModule:
    """Write `node.meta["stream"]` on every compute node of `gm` (in place; returns it)."""
    nodes = _compute_nodes(gm.graph)
    for node in nodes:
        marked = node.meta.get(_USER_KEY)
        if marked is not None and marked >= options.num_streams:
            raise ConfigError(f"dr.stream({marked}) used in forward (node {node.name}) but "
                              f"MultiStreamOptions.num_streams={options.num_streams}: ids must be < num_streams")
    if options.policy == "none" or options.num_streams == 1:
        assignment = {n: 0 for n in nodes}
    elif options.policy == "user":
        assignment = {n: n.meta.get(_USER_KEY, 0) for n in nodes}
    elif options.policy == "embedding":
        assignment = _embedding_streams(gm, options.num_streams)
    else:
        assignment = _full_streams(gm, options.num_streams)
    for node in nodes:
        node.meta[STREAM_KEY] = assignment[node]
    return gm


def stream_summary(gm: torch.fx.GraphModule) -> dict[int, list[str]]:
    """stream id -> names of its nodes, in graph order (what `explain()` prints)."""
    out: dict[int, list[str]] = {}
    for node in _compute_nodes(gm.graph):
        if STREAM_KEY in node.meta:
            out.setdefault(node.meta[STREAM_KEY], []).append(node.name)
    return dict(sorted(out.items()))
