"""Capture `forward(batch)` as a torch.fx graph, with an error that points at the
user's source line when tracing fails."""
from __future__ import annotations

import os
import traceback

import torch
import torch.fx

from deeprec.errors import DeepRecError
from deeprec.graph.multi_stream import record_user_stream

_TORCH_DIR = os.path.dirname(torch.__file__)
_DEEPREC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_USER_CODE_INSIDE_DEEPREC = (os.path.join(_DEEPREC_DIR, "models"),)


class _Tracer(torch.fx.Tracer):
    """Modules that set `_deeprec_leaf = True` (e.g. FusedLookup) are single nodes;
    nodes created inside `with dr.stream(i):` remember i."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return getattr(m, "_deeprec_leaf", False) or super().is_leaf_module(m, module_qualified_name)

    def create_node(self, *args, **kwargs):
        node = super().create_node(*args, **kwargs)
        record_user_stream(node)
        return node


class CaptureError(DeepRecError):
    """forward could not be traced; names the source line to change."""


def _is_user_frame(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path.startswith(_USER_CODE_INSIDE_DEEPREC):
        return True
    return not (path.startswith(_TORCH_DIR) or path.startswith(_DEEPREC_DIR) or filename.startswith("<"))


def capture(model: torch.nn.Module) -> torch.fx.GraphModule:
    """Trace `model.forward(batch)`; `deeprec.ops` and `@deeprec.op` functions are single nodes."""
    try:
        tracer = _Tracer()
        graph = tracer.trace(model)
        gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    except Exception as err:  # anything tracing trips on: control flow, len(), numpy on proxies
        frames = [f for f in traceback.extract_tb(err.__traceback__) if _is_user_frame(f.filename)]
        where = ""
        if frames:
            last = frames[-1]
            where = f"\n  at {last.filename}:{last.lineno}: {(last.line or '').strip()}"
        raise CaptureError(
            f"cannot trace {type(model).__name__}.forward with torch.fx: {type(err).__name__}: {err}{where}\n"
            "Move the code that cannot be traced (Python control flow on tensor values, numpy, "
            "len() of a batch column) into a function decorated with @deeprec.op: it then runs "
            "as one graph node.") from err
    # `from __future__ import annotations` leaves string annotations on placeholders,
    # which fx then emits as globals that cannot be pickled: drop them.
    for node in gm.graph.nodes:
        if isinstance(node.type, str):
            node.type = None
    gm.recompile()
    return gm
