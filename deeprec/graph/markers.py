"""Markers a model may use inside `forward`; identities at run time, single nodes when traced."""
from __future__ import annotations

from deeprec.ops.graph_op import op


@op(outputs=lambda *values: None if len(values) == 1 else len(values))
def staged(*values):
    """Manual stage boundary, like `tf.staged`: everything these values depend on
    runs in the background stage. Returns its arguments (one value or a tuple)."""
    return values[0] if len(values) == 1 else values


@op
def mark_target_node(value):
    """Like `tf.train.mark_target_node`: this value and everything computed from
    it stay in the training step, never in the stage. Returns `value`."""
    return value
