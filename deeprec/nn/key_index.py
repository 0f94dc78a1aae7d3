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


class KeyIndex:
    """(namespace, int64 key) -> row (-1: not held). Namespaces (0 by default) let one index
    hold the keys of several variables (the PS arena)."""

    def __init__(self, capacity: int = 1024):
        self.table = torch.full((2 * slots_for(capacity),), -1, dtype=torch.int64)
        self.entries = 0

    @property
    def slots(self) -> int:
        return self.table.numel() // 2

    def reserve(self, n: int) -> None:
        """Room for n more entries: the table is rehashed into twice the slots it needs when
        it would pass half full."""
        needed = self.entries + n
        if 2 * needed > self.slots:
            bigger = torch.empty(2 * slots_for(needed), dtype=torch.int64)
            torch.ops.deeprec.key_index_rehash(self.table, bigger)
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
