"""Capture `forward(batch)` as a torch.fx graph, with an error that points at the
user's source line, and the fix for that line, when tracing fails.

Single graph nodes, never traced into: `deeprec.ops` and `@deeprec.op` functions, every
embedding lookup (`deeprec.nn.EmbeddingLookup`: EmbeddingVariable, EmbeddingCollection's
FusedLookup, ...), torch.nn's own layers, and classes marked with `@deeprec.leaf_module`.
"""
from __future__ import annotations

import os
import traceback
import weakref

import torch
import torch.fx
from torch import nn

from deeprec.errors import DeepRecError
from deeprec.graph.multi_stream import record_user_stream
from deeprec.nn.lookup import EmbeddingLookup

_TORCH_DIR = os.path.dirname(torch.__file__)
_DEEPREC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_USER_CODE_INSIDE_DEEPREC = (os.path.join(_DEEPREC_DIR, "models"),)
_LEAF_CLASSES: weakref.WeakSet = weakref.WeakSet()


def leaf_module(cls: type) -> type:
    """Class decorator: modules of this class are one graph node when `forward` is captured; their
    own forward runs untraced (Python control flow, loops over steps, numpy). Their inputs and
    outputs must be tensors (or tuples, lists, dicts of them). Subclasses are leaves too."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"dr.leaf_module marks an nn.Module class (decorate the class, or pass it), got {cls!r}")
    _LEAF_CLASSES.add(cls)
    return cls


def is_leaf_module(module: nn.Module) -> bool:
    """Captured as one node by deeprec (torch.nn's layers are leaves for torch.fx already)."""
    return isinstance(module, EmbeddingLookup) or isinstance(module, tuple(_LEAF_CLASSES))


class _Tracer(torch.fx.Tracer):
    """Embedding lookups and `@leaf_module` classes are single nodes; nodes created
    inside `with dr.stream(i):` remember i."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return is_leaf_module(m) or super().is_leaf_module(m, module_qualified_name)

    def create_node(self, *args, **kwargs):
        node = super().create_node(*args, **kwargs)
        record_user_stream(node)
        return node


class CaptureError(DeepRecError):
    """forward could not be traced; names the source line to change and how."""


def _is_user_frame(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path.startswith(_USER_CODE_INSIDE_DEEPREC):
        return True
    return not (path.startswith(_TORCH_DIR) or path.startswith(_DEEPREC_DIR) or filename.startswith("<"))


def _advice(err: Exception, frame, model: nn.Module) -> str:
    """The fix that works for the failing line: a module whose forward cannot be traced becomes a
    leaf; a helper function an op; in forward itself, what the failure was about."""
    message = str(err)
    owner = frame.f_locals.get("self") if frame is not None else None
    function = frame.f_code.co_name if frame is not None else "forward"
    if isinstance(owner, nn.Module) and owner is not model:
        cls = type(owner).__name__
        return (f"The failing line is inside {cls}.{function}, called as a module from forward: decorate "
                f"`class {cls}` with @deeprec.leaf_module (or call deeprec.leaf_module({cls})) so it runs as one "
                "graph node, untraced (its inputs and outputs must be tensors, or tuples/dicts of tensors).")
    if owner is None and frame is not None and function not in ("<module>", "<lambda>"):
        return (f"The failing line is in the function {function}(): decorate it with @deeprec.op so it runs as "
                "one graph node, untraced (tensors in, tensors or a tuple of tensors out).")
    if "'len' is not supported" in message:
        return ("len() of a traced value: use `x.shape[0]` (traced as a size), or move the code into a "
                "function decorated with @deeprec.op.")
    if "cannot be iterated" in message:
        return ("A loop over a traced value: index it (`a, b = value`, `value[i]` with a Python int i), or move "
                "the loop into a function decorated with @deeprec.op.")
    if "control flow" in message:
        return ("Python control flow on tensor values (`if`, `while`, `and`/`or`, bool(), int()): move this "
                "code into a function decorated with @deeprec.op (it runs as one graph node), or write it with "
                "tensor ops (torch.where, masks).")
    return ("Move the code that cannot be traced (numpy, Python values read from tensors) into a function "
            "decorated with @deeprec.op: it then runs as one graph node.")


def _failing_user_frame(err: Exception):
    """(frame, summary) of the innermost user frame of the traceback, or (None, None)."""
    found = (None, None)
    for frame, lineno in traceback.walk_tb(err.__traceback__):
        if _is_user_frame(frame.f_code.co_filename):
            found = (frame, lineno)
    if found[0] is None:
        return None, None
    frame, lineno = found
    summary = traceback.FrameSummary(frame.f_code.co_filename, lineno, frame.f_code.co_name)
    return frame, summary


def capture(model: nn.Module) -> torch.fx.GraphModule:
    """Trace `model.forward(batch)`; `deeprec.ops` and `@deeprec.op` functions are single nodes."""
    try:
        tracer = _Tracer()
        graph = tracer.trace(model)
        gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    except Exception as err:  # anything tracing trips on: control flow, len(), numpy on proxies
        frame, last = _failing_user_frame(err)
        where = f"\n  at {last.filename}:{last.lineno}: {(last.line or '').strip()}" if last is not None else ""
        raise CaptureError(f"cannot trace {type(model).__name__}.forward with torch.fx: {type(err).__name__}: "
                           f"{err}{where}\n{_advice(err, frame, model)}") from err
    # `from __future__ import annotations` leaves string annotations on placeholders,
    # which fx then emits as globals that cannot be pickled: drop them.
    for node in gm.graph.nodes:
        if isinstance(node.type, str):
            node.type = None
    gm.recompile()
    return gm
