"""The one key index of deeprec: (namespace, int64 key) -> row, in native ops (deeprec/csrc/key_index.cpp).

    table int64 [2C]: slot s = (key, namespace << 40 | row) or (., -1) empty; kept <= half full

The local EmbeddingVariable, the tiered one (its DRAM and disk indexes), the counter
filter's pending keys and the PS shard's arena hold one each. The table is a tensor: a
copy, a pickle or a `deepcopy` of its owner copies it as it is (nothing to rebuild). Every
call runs in C++ without the GIL; the owner's lock orders callers.

`find_rows` reaches the op's whole interface (many indexes in one call: lookup-or-insert,
deduplication, frequency counts); the EmbeddingVariables' fused lookup (deeprec/csrc/ev_lookup.cpp)
runs the same find-or-insert core.
"""
from __future__ import annotations

import math
import mmap

import torch

import deeprec._C  # noqa: F401  (registers torch.ops.deeprec.key_index_*)

NO_KEYS = torch.empty(0, dtype=torch.int64)  # "none given" to the ops (no namespaces, no counts)
_MIN_SLOTS = 16


def slots_for(entries: int) -> int:
    """A power of two of at least 2 x entries (the table stays <= half full)."""
    slots = _MIN_SLOTS
    while slots < 2 * entries:
        slots *= 2
    return slots


# Linux's MAP_NORESERVE (Python's mmap module names it from 3.13 on): reserve address space
# without committing memory; a page costs RAM only once it is written
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


def reserved_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor whose memory is reserved, not committed: an anonymous
    private mapping, so rows cost RAM only when first written. A table that grows row by
    row in such a tensor never copies what it holds (doubling a tensor copies it, and
    faults in the new pages anyway). Raises OSError when the address space is refused
    (vm.overcommit_memory=2 may); callers fall back to doubling."""
    count = math.prod(shape)
    if not count:
        return torch.empty(shape, dtype=dtype)
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    # the tensor holds a reference to the mapping: it is unmapped with the last tensor using it
    return torch.frombuffer(region, dtype=dtype, count=count).view(shape)


class KeyIndex:
    """(namespace, int64 key) -> row (-1: not held). Namespaces (0 by default) let one index
    hold the keys of several variables (the PS arena).

    `most`: the entries it may come to hold (the PS arena's rows within its memory budget): address
    space for that table is reserved up front (`reserved_empty`: pages committed as the table
    reaches them), so the table grows in place, with no copy and no second table."""

    def __init__(self, capacity: int = 1024, most: int = 0):
        self._space = None  # the reserved address space the table is a prefix of
        if most > capacity:
            try:
                self._space = reserved_empty((2 * slots_for(most),), torch.int64)
            except OSError:  # address space refused (strict overcommit): grow by copying
                pass
        slots = slots_for(capacity)
        self.table = torch.empty(2 * slots, dtype=torch.int64) if self._space is None else self._space[:2 * slots]
        self.table.fill_(-1)
        self.entries = 0

    def __getstate__(self) -> dict:  # a copy holds its table, not the address space reserved for it
        return {**self.__dict__, "_space": None, "table": self.table if self._space is None else self.table.clone()}

    @property
    def slots(self) -> int:
        return self.table.numel() // 2

    def reserve(self, n: int) -> None:
        """Room for n more entries: the table grows to twice the slots it needs when it would
        pass half full, in place (csrc/key_index.cpp, key_index_grow): in its reserved address
        space, else in a new tensor that first takes a copy of it."""
        needed = self.entries + n
        if 2 * needed > self.slots:
            size = 2 * slots_for(needed)
            if self._space is not None and size <= self._space.numel():
                bigger = self._space[:size]  # the table is its prefix already
            else:
                bigger, self._space = torch.empty(size, dtype=torch.int64), None
                bigger[:self.table.numel()] = self.table
            torch.ops.deeprec.key_index_grow(bigger, self.slots)
            self.table = bigger

    def lookup(self, keys: torch.Tensor, ns: torch.Tensor | None = None) -> torch.Tensor:
        """The row of each key, -1 where not held."""
        rows, _, _, _ = torch.ops.deeprec.key_index_find(
            [self.table], [NO_KEYS], [NO_KEYS], [NO_KEYS if ns is None else ns], [keys.to(torch.int64)], [NO_KEYS],
            [0], False, False)
        return rows[0]

    def find(self, keys: torch.Tensor, row_keys: torch.Tensor, size: int, ns: torch.Tensor | None = None,
             freq: torch.Tensor | None = None, insert: bool = True) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Lookup-or-insert: (row of each key, positions that created a row in row order, how
        many positions repeat an earlier held key). New keys take rows size, size + 1, ... (first
        seen first; `row_keys` [at least size + len(keys)] gets their keys); `freq` (optional)
        counts one per position of a held key. `insert=False`: a key not held reads -1."""
        if insert:
            self.reserve(keys.numel())
        rows, _, fresh, stats = torch.ops.deeprec.key_index_find(
            [self.table], [row_keys], [NO_KEYS if freq is None else freq], [NO_KEYS if ns is None else ns],
            [keys.to(torch.int64)], [NO_KEYS], [size], insert, False)
        self.entries += fresh[0].numel()
        return rows[0], fresh[0], int(stats[0, 1])

    def assign(self, keys: torch.Tensor, rows: torch.Tensor, ns: torch.Tensor | None = None) -> int:
        """keys -> rows, inserted or overwritten; returns how many keys were new."""
        self.reserve(keys.numel())
        added = torch.ops.deeprec.key_index_assign(self.table, NO_KEYS if ns is None else ns, keys.to(torch.int64),
                                                   rows.to(torch.int64))
        self.entries += added
        return added

    def remove(self, keys: torch.Tensor, ns: torch.Tensor | None = None) -> int:
        """Forget the keys (those not held are ignored); returns how many were held."""
        removed = torch.ops.deeprec.key_index_remove(self.table, NO_KEYS if ns is None else ns, keys.to(torch.int64))
        self.entries -= removed
        return removed

    def clear(self, capacity: int = 1024) -> None:
        self.__init__(capacity)

    def items(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(namespaces, keys, rows) of every entry, in slot order."""
        return torch.ops.deeprec.key_index_entries(self.table)

    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()


def find_rows(indexes: list[KeyIndex], row_keys: list[torch.Tensor], freqs: list[torch.Tensor],
              keys: list[torch.Tensor], counts: list[torch.Tensor | None], sizes: list[int], insert: bool,
              dedup: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Many indexes in one op call (see deeprec/csrc/key_index.cpp, key_index_find): per part the
    rows (dedup: of the distinct keys, first seen first), the inverse (dedup), the places that
    created a row, and stats [parts, 3] = (places not held, repeated positions, places).
    With `insert`, each row_keys[i] must have room for sizes[i] + len(keys[i]) rows."""
    if insert:
        for index, part in zip(indexes, keys):
            index.reserve(part.numel())
    rows, inverse, fresh, stats = torch.ops.deeprec.key_index_find(
        [index.table for index in indexes], row_keys, freqs, [NO_KEYS] * len(indexes), keys,
        [NO_KEYS if c is None else c for c in counts], sizes, insert, dedup)
    if insert:
        for index, new in zip(indexes, fresh):
            index.entries += new.numel()
    return rows, inverse, fresh, stats
