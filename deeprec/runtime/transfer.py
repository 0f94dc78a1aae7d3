"""Moving stage outputs to the training device.

`stage_subgraph_on_cpu=True` (CUDA): the runner thread packs every tensor of a
stage result into one pinned host buffer and issues a single non-blocking
host-to-device copy on a side stream, recording an event; the main step waits
on that event (not on the whole side stream) and marks the device buffer as
used by its own stream so the caching allocator cannot recycle it early.
Without it, each tensor is copied when the main step takes the batch.
"""
from __future__ import annotations

import torch

from deeprec.runtime.prefetch import StagedBatch

_ALIGN = 64


def _tensor_slots(values: tuple):
    return [(i, v) for i, v in enumerate(values) if isinstance(v, torch.Tensor)]


class PackedCopier:
    """Runner-side transfer: one pinned buffer, one H2D copy per batch, on a side stream."""

    def __init__(self, device: torch.device, stream_id: int = 0):
        self.device = device
        self.stream_id = stream_id
        self.stream = torch.cuda.Stream(device=device)  # stream ids index side streams

    def __call__(self, item: StagedBatch) -> StagedBatch:
        slots = _tensor_slots(item.values)
        if not slots:
            return item
        offsets, total = [], 0
        for _, t in slots:
            total = (total + _ALIGN - 1) // _ALIGN * _ALIGN
            offsets.append(total)
            total += t.numel() * t.element_size()
        host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        for (_, t), off in zip(slots, offsets):
            nbytes = t.numel() * t.element_size()
            host[off:off + nbytes].view(t.dtype).view(t.shape).copy_(t.contiguous())
        with torch.cuda.stream(self.stream):
            device_buf = host.to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        values = list(item.values)
        for (i, t), off in zip(slots, offsets):
            nbytes = t.numel() * t.element_size()
            values[i] = device_buf[off:off + nbytes].view(t.dtype).view(t.shape)
        item.values, item.ready, item.keepalive = tuple(values), ready, (host, device_buf)
        return item


def make_ready(item: StagedBatch, device: torch.device) -> tuple:
    """Consumer side: the stage values, usable on the main stream of `device`."""
    if device.type != "cuda":
        return item.values
    if item.ready is not None:
        main = torch.cuda.current_stream(device)
        main.wait_event(item.ready)
        item.keepalive[1].record_stream(main)
        return item.values
    return tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in item.values)
