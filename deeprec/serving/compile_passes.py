"""Graph passes of the serving compile (AOTInductor), run on its post-grad ATen graph after inductor's
own passes. Each is a function from graph to graph (in place, as inductor's passes are), tested alone
in tests/test_compile_passes.py; `ServingPasses` hands them to inductor as one custom pass.

    unfuse_bias   addmm(bias, x, w) whose every user is pointwise (the ReLU after a Linear, the
                  sigmoid after the last one) -> mm(x, w) + bias: MKL no longer copies the bias into
                  the output before the GEMM (a pass over [B, N]); the add joins the users' fused
                  kernel. Inductor does this on GPUs only (post_grad's should_prefer_unfused_addmm);
                  on a 2-core Xeon the DLRM package scores 1.04x / 1.03x / 1.06x at 1 / 64 / 256
                  rows (one thread, 15 alternating rounds). The sum is ordered otherwise (the bias
                  added last, not first): values within float rounding of the ExportedProgram's, as
                  a compiled package's already are.

Tried and not kept: DLRM's Gram matrix gathered at its pairs (bmm, then index) as the pairs' dots
(gather, multiply, sum in one fused kernel): 2x faster alone, but in the whole program inductor fuses
the vectors' concatenation into it and the package lost the gain at 64 and 256 rows.
"""
from __future__ import annotations

import hashlib

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import is_pointwise_use

aten = torch.ops.aten


def unfuse_bias(graph: torch.fx.Graph) -> torch.fx.Graph:
    """Each CPU addmm(bias, x, w) (alpha = beta = 1) whose users are all pointwise, as mm(x, w) + bias."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.addmm.default or node.kwargs:
            continue
        value = node.meta.get("val")
        # bf16 / half: mm would round the sum before the bias is added (addmm adds it in float32)
        if (not isinstance(value, torch.Tensor) or value.device.type != "cpu"
                or value.dtype not in (torch.float32, torch.float64)):
            continue
        if not node.users or not all(is_pointwise_use(user) for user in node.users):
            continue
        bias, x, w = node.args
        with graph.inserting_before(node):
            # addmm's metadata on both (the same shape, dtype and strides); inductor's FakeTensorUpdater,
            # which runs after the custom post pass, recomputes the values of the nodes that changed
            product = graph.call_function(aten.mm.default, (x, w))
            product.meta.update(node.meta)
            biased = graph.call_function(aten.add.Tensor, (product, bias))
            biased.meta.update(node.meta)
        node.replace_all_uses_with(biased)
        graph.erase_node(node)
    return graph


PASSES = (unfuse_bias,)
with open(__file__, "rb") as _source:  # the code imported, whatever the file becomes later
    _DIGEST = hashlib.sha256(_source.read()).hexdigest()[:16]


class ServingPasses(CustomGraphPass):
    """PASSES as inductor's `post_grad_custom_post_pass`. Its uuid (and repr: the compile cache's key
    holds the options as text) is this file's digest: a change to a pass compiles packages anew."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for graph_pass in PASSES:
            graph_pass(graph)

    def uuid(self) -> str:
        return _DIGEST

    def __repr__(self) -> str:
        return f"ServingPasses({self.uuid()})"
