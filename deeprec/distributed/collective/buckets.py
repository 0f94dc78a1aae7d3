"""Collective training's dense half: DDP's bucketed gradient averaging, overlapped with the backward.

    backward ──grads of bucket 0 ready──> all_reduce(bucket 0, async) ─┐   (buckets in backward order,
             ──grads of bucket 1 ready──> all_reduce(bucket 1, async) ─┤    launched strictly in index
             ...                                                       │    order so every rank pairs
    apply:   wait for each bucket, grads = sum / N  <──────────────────┘    them alike)

In DLRM the top MLP's gradients (most of the dense bytes) are ready first: their all-reduce runs
while the embedding gradients are exchanged and the bottom MLP's backward runs. With micro-batches
(`overlap=False`) nothing is launched inside the backwards (they accumulate); `wait()` launches
every bucket, in the same order. Written here rather than wrapping the model in DDP: SmartStage
captures the model's graph, and DDP's forward hooks would sit inside it.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from deeprec.distributed.allreduce import Traffic

BUCKET_BYTES = 512 * 1024  # DDP's default is 25 MiB; a recommendation model's dense part is a few MiB


class BucketedAllReduce:
    """Averages `params`' gradients over the ranks of `group` each step."""

    def __init__(self, params: list[torch.Tensor], group=None, bucket_bytes: int = BUCKET_BYTES,
                 overlap: bool = True):
        self.group, self.overlap = group, overlap
        self.world = dist.get_world_size(group)
        self.buckets: list[list[torch.Tensor]] = [[]]
        for p in reversed(params):  # backward produces gradients roughly in reverse order of definition
            if self.buckets[-1] and sum(q.numel() * q.element_size() for q in self.buckets[-1]) >= bucket_bytes:
                self.buckets.append([])
            self.buckets[-1].append(p)
        self.buckets = [b for b in self.buckets if b]
        self.flats = [torch.zeros(sum(p.numel() for p in b), device=b[0].device) for b in self.buckets]
        self.traffic = Traffic()  # seconds: waiting in apply (what the overlap did not hide)
        self._reset()
        if overlap:
            for index, bucket in enumerate(self.buckets):
                for p in bucket:
                    p.register_post_accumulate_grad_hook(lambda p, index=index: self._accumulated(index))

    def _reset(self) -> None:
        self.remaining = [len(b) for b in self.buckets]
        self.works: list = []  # launched, in bucket order

    def _accumulated(self, index: int) -> None:
        self.remaining[index] -= 1
        while len(self.works) < len(self.buckets) and self.remaining[len(self.works)] <= 0:
            self._launch(len(self.works))

    def _launch(self, index: int) -> None:
        bucket, flat = self.buckets[index], self.flats[index]
        torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad.to_dense()).reshape(-1) for p in bucket],
                  out=flat)
        self.works.append(dist.all_reduce(flat, group=self.group, async_op=True))
        self.traffic.bytes_sent += int(2 * (self.world - 1) / self.world * flat.numel() * flat.element_size())

    def wait(self) -> None:
        """Launch what the backward did not (a parameter without gradient, or overlap off), wait for
        every bucket, and leave each parameter's .grad the mean over the ranks."""
        started = time.perf_counter()
        while len(self.works) < len(self.buckets):
            self._launch(len(self.works))
        for work, bucket, flat in zip(self.works, self.buckets, self.flats):
            work.wait()
            flat /= self.world
            offset = 0
            for p in bucket:
                mean = flat[offset:offset + p.numel()].view_as(p)
                if p.grad is None or p.grad.is_sparse:
                    p.grad = mean.clone()
                else:
                    p.grad.copy_(mean)
                offset += p.numel()
        self.traffic.add(time.perf_counter() - started, 0)
        self._reset()

    def finite(self) -> bool:
        """Whether the averaged gradients are all finite (the same answer on every rank)."""
        for flat in self.flats:
            low, high = torch.aminmax(flat)
            if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
                return False
        return True
