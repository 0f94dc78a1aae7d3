"""The disk tier of an EmbeddingVariable: fixed-size row records in one file, memory-mapped.

    record (one per slot) = [float32 x width | int64 key, freq, version]   (8-byte aligned)
    slot ──free list (slots of rows that went back to DRAM)──> reused before the file grows

A batch of rows is one `index_select` over the mapping (read) or one indexed copy into
it (write), never a call per key. The file is unlinked as soon as it is created: the
mapping and an open descriptor keep it alive, and nothing is left on disk when the
process ends, however it ends (a killed run resumes from its checkpoint, never from
these files). Chosen over LMDB by `bench/tiered_store.py`: 1.5 / 3.0 ms vs 17.2 / 24.2 ms
to read / write 13k random 128-byte rows of 1M (README, "Multi-tier storage").
"""
from __future__ import annotations

import os
import tempfile

import torch

_INTS = 3  # key, freq, version


class DiskRows:
    def __init__(self, directory: str, name: str, width: int, capacity: int = 1024):
        os.makedirs(directory, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=f"deeprec-ev-{name}-", suffix=".rows", dir=directory)
        os.unlink(path)  # scratch: gone with the process (see the module docstring)
        self.fd, self.directory = fd, directory
        self.width = width + (width % 2)  # floats padded to 8 bytes: the ints stay aligned
        self.record_bytes = 4 * self.width + 8 * _INTS
        self.size = 0  # slots ever used (the file's high-water mark)
        self.used = torch.zeros(0, dtype=torch.bool)
        self.dirty = torch.zeros(0, dtype=torch.bool)  # changed since the last full checkpoint
        self._free = torch.zeros(0, dtype=torch.int64)
        self._map(capacity)

    def _map(self, capacity: int) -> None:
        os.ftruncate(self.fd, capacity * self.record_bytes)  # sparse: blocks are allocated as written
        raw = torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=capacity * self.record_bytes,
                              dtype=torch.uint8).view(capacity, self.record_bytes)
        self.floats = raw[:, : 4 * self.width].view(torch.float32)
        self.ints = raw[:, 4 * self.width:].view(torch.int64)
        grown = capacity - self.used.numel()
        self.used = torch.cat([self.used, torch.zeros(grown, dtype=torch.bool)])
        self.dirty = torch.cat([self.dirty, torch.zeros(grown, dtype=torch.bool)])

    @property
    def capacity(self) -> int:
        return self.used.numel()

    @property
    def rows(self) -> int:
        return self.size - self._free.numel()

    def nbytes(self) -> int:
        """Bytes of the file (slots ever used; freed ones are reused)."""
        return self.size * self.record_bytes

    def allocate(self, n: int) -> torch.Tensor:
        """n slots: freed ones first, then new ones at the end of the file."""
        reuse = min(n, self._free.numel())
        slots = self._free[self._free.numel() - reuse:]
        self._free = self._free[: self._free.numel() - reuse]
        fresh = n - reuse
        if self.size + fresh > self.capacity:
            self._map(max(self.size + fresh, 2 * self.capacity))  # the file grows; nothing is copied
        slots = torch.cat([slots, torch.arange(self.size, self.size + fresh, dtype=torch.int64)])
        self.size += fresh
        self.used[slots] = True
        return slots

    def release(self, slots: torch.Tensor) -> None:
        self.used[slots] = False
        self.dirty[slots] = False
        self._free = torch.cat([self._free, slots])

    def write(self, slots: torch.Tensor, floats: torch.Tensor, keys: torch.Tensor, freq: torch.Tensor,
              version: torch.Tensor, dirty: torch.Tensor) -> None:
        order = torch.argsort(slots)  # ascending offsets: the kernel writes pages back in order
        slots = slots[order]
        self.floats[slots, : floats.shape[1]] = floats[order]
        self.ints[slots] = torch.stack([keys, freq, version], 1)[order]
        self.dirty[slots] = dirty[order]

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(floats [n, width], ints [n, 3]: key, freq, version) of the slots, in their order."""
        return self.floats.index_select(0, slots), self.ints.index_select(0, slots)

    def live(self, dirty_only: bool = False) -> torch.Tensor:
        """Slots holding a row (changed since the last full checkpoint, with `dirty_only`)."""
        mask = self.used[: self.size] & self.dirty[: self.size] if dirty_only else self.used[: self.size]
        return torch.nonzero(mask).squeeze(1)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the mapping lives until its tensors go; then the blocks are freed
            self.fd = -1
