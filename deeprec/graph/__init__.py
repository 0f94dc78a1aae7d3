"""Graph capture (torch.fx), markers usable inside forward, and the passes."""
from deeprec.graph.capture import CaptureError, capture, is_leaf_module, leaf_module
from deeprec.graph.markers import mark_target_node, staged
from deeprec.graph.smart_stage import StagePartition, find_stage_region, smart_stage_pass
from deeprec.graph.multi_stream import (MultiStreamOptions, colocate_with, minimum_chains, multi_stream_pass,
                                        stream, stream_summary)

__all__ = ["CaptureError", "capture", "is_leaf_module", "leaf_module", "mark_target_node", "staged", "StagePartition",
           "find_stage_region", "smart_stage_pass", "MultiStreamOptions", "colocate_with", "minimum_chains",
           "multi_stream_pass", "stream", "stream_summary"]
