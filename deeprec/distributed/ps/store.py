"""Fused storage of a PS shard: a pull or push is a few tensor ops, whatever the number of variables.

    EmbeddingArena   every embedding variable of one (dim, optimizer) on the shard
        (variable, key) ──KeyIndex (deeprec/nn/key_index.py: C++, no GIL)──> row
        row ──> weight [R, dim] | optimizer slots | freq | version       (one arena of rows)
    DenseGroup       every dense variable of one optimizer: one flat buffer, one optimizer step

Rows are never moved except by `load` (which rebuilds the arena), so a row number
stays valid between a pull and the push of the same step. The arrays are reserved for the
shard's whole memory budget (address space, committed as rows are written), and so is the
key index's table, so an insert never copies the arena, and the index grows in place when it
passes half full.
"""
from __future__ import annotations

import torch

import deeprec._C  # noqa: F401  (registers torch.ops.deeprec.ps_init_rows, ps_gather_rows)
from deeprec.nn.key_index import KeyIndex, reserved_empty, slots_for
from deeprec.nn.variable import shard_of
from deeprec.optim import sparse
from deeprec.nn.lookup import merge_rows

_INDEX_BYTES = 32  # 2 table slots per row (kept <= half full) x 16 bytes
_NO_FLAGS = torch.empty(0, dtype=torch.bool)  # ev_apply_'s dirty flags: an arena keeps none


class EmbeddingArena:
    """The embedding variables of one dim and optimizer: rows of all of them in one arena."""

    def __init__(self, dim: int, optimizer: sparse.RowSparseOptimizer, capacity: int = 1024,
                 reserve_bytes: int = 0):
        self.dim, self.optimizer = dim, optimizer
        # rows whose address space is reserved up front (the shard's memory budget in rows):
        # the arena then grows without copying, its pages committed as rows are written
        self.reserve_rows = reserve_bytes // self.bytes_per_row()
        self.names: list[str] = []  # variable id (the key's namespace) -> name
        # every variable's initializer matrix, stacked (held once): a new key k of variable v starts
        # as row k % count[v] of its span
        self._default_matrix = torch.zeros(0, dim)
        self._default_offset = self._default_count = torch.zeros(0, dtype=torch.int64)
        self._allocate(capacity)

    def _allocate(self, rows: int) -> None:
        self.size = 0
        # the index too grows in place within the address space of the budget's rows
        self.index = KeyIndex(rows, most=self.reserve_rows)
        if rows < self.reserve_rows:
            try:
                return self._arrays(self.reserve_rows, reserved_empty)
            except OSError:  # address space refused (strict overcommit): grow by doubling
                self.reserve_rows = 0
        self._arrays(rows, lambda shape, dtype: torch.empty(shape, dtype=dtype))

    def _arrays(self, capacity: int, empty) -> None:
        self.row_ns = empty((capacity,), torch.int64)
        self.row_keys = empty((capacity,), torch.int64)
        self.weight = empty((capacity, self.dim), torch.float32)
        self.freq = empty((capacity,), torch.int64)
        self.version = empty((capacity,), torch.int64)
        # rows past `size` are uninitialized: an insert sets a row and its slots
        self.slots = {name: empty((capacity, self.dim) if per_element else (capacity,), torch.float32)
                      for name, (_, per_element) in self.optimizer.slot_specs().items()}

    @property
    def capacity(self) -> int:
        return self.row_keys.numel()

    def add(self, name: str, defaults: torch.Tensor) -> int:
        """A new variable; `defaults` [n, dim] is its initializer matrix. Returns its id."""
        self.names.append(name)
        self._default_matrix = torch.cat([self._default_matrix, defaults.float()])
        counts = torch.cat([self._default_count, torch.tensor([defaults.shape[0]])])
        self._default_offset, self._default_count = torch.cumsum(counts, 0) - counts, counts
        return len(self.names) - 1

    def bytes_per_row(self) -> int:
        """A row's bytes, its index entry included (the index is kept <= half full)."""
        return self._row_bytes() + _INDEX_BYTES

    def _row_bytes(self) -> int:
        return row_bytes(self.dim, self.optimizer)

    def memory(self) -> int:
        """Bytes held: the rows in use (a reserved arena commits no more) or allocated, and the index."""
        rows = self.size if self.reserve_rows else self.capacity
        return rows * self._row_bytes() + self.index.nbytes() + self._default_matrix.numel() * 4

    def _reserve(self, n: int) -> None:
        """Room for n more rows (arrays doubled, the index rehashed, when needed)."""
        needed = self.size + n
        if needed > self.capacity:
            capacity = max(needed, 2 * self.capacity)
            live = slice(0, self.size)
            self.row_ns, self.row_keys = _grown(self.row_ns, capacity, live), _grown(self.row_keys, capacity, live)
            self.weight = _grown(self.weight, capacity, live)
            self.freq, self.version = _grown(self.freq, capacity, live), _grown(self.version, capacity, live)
            self.slots = {name: _grown(slot, capacity, live) for name, slot in self.slots.items()}

    def rows(self, ns: torch.Tensor, keys: torch.Tensor, insert: bool) -> tuple[torch.Tensor, int]:
        """(row of each (variable id, key), how many repeat an earlier pair). A pair not held
        reads -1, unless `insert` creates it (from its variable's initializer, one row per pair)."""
        if insert:
            self._reserve(keys.numel())
        # one op: rows found (or created: their keys written), repeats counted, (insert:) freq counted
        rows, fresh, repeated = self.index.find(keys, self.row_keys, self.size, ns=ns,
                                                freq=self.freq if insert else None, insert=insert)
        if fresh.numel():  # the new rows' variable, initial value, version and slots: one pass (csrc/ps_rows.cpp)
            specs = self.optimizer.slot_specs()
            torch.ops.deeprec.ps_init_rows(fresh, ns, keys, self.size, self.row_ns, self.weight, self.version,
                                           self.optimizer.step_count, list(self.slots.values()),
                                           [float(specs[name][0]) for name in self.slots], self._default_matrix,
                                           self._default_offset, self._default_count)
            self.size += fresh.numel()
        return rows, int(repeated)

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """weight[rows]; a row -1 (a key never trained) reads zeros."""
        if out is None:
            out = torch.empty(rows.numel(), self.dim)
        torch.ops.deeprec.ps_gather_rows(self.weight, rows, out)
        return out

    def apply(self, rows: torch.Tensor, grad: torch.Tensor, repeated: bool = True, held: bool = False) -> None:
        """One optimizer step over every variable's rows (-1 rows dropped, duplicates summed), each
        row stamped with the step (its version). `held`: every row is >= 0 (a training pull's)."""
        if not held:
            known = rows >= 0
            if not bool(known.all()):
                rows, grad = rows[known], grad[known]
        if repeated:  # a row given twice (sync pushes, repeated keys): gradients summed
            rows, grad = merge_rows(rows, grad)
        self.optimizer.begin_step()
        fused = self.optimizer.fused()
        if fused is None:  # an optimizer without a native kernel (FTRL)
            self.optimizer.update(self.weight, self.slots, rows, grad)
            self.version[rows] = self.optimizer.step_count
            return
        kind, slot_names, hyper = fused  # update and version stamp in one op (csrc/sparse_optim.cpp)
        torch.ops.deeprec.ev_apply_(kind, [self.weight], [self.slots[n] for n in slot_names], [self.version],
                                    [_NO_FLAGS], [rows], grad.contiguous(), hyper, self.optimizer.step_count)

    def export(self, var: int) -> dict:
        """One variable's rows with their slots (as EmbeddingVariable.export writes them)."""
        rows = torch.nonzero(self.row_ns[: self.size] == var).squeeze(1)
        state = {"keys": self.row_keys[rows], "values": self.weight[rows], "freq": self.freq[rows],
                 "version": self.version[rows], "global_step": torch.tensor(self.optimizer.step_count)}
        state.update({f"slot.{name}": slot[rows] for name, slot in self.slots.items()})
        return state

    def load(self, states: dict[int, dict], shard_index: int, num_shards: int) -> None:
        """Replace the rows of the variables in `states` (keeping this shard's keys); the
        other variables keep theirs. The arena is rebuilt, so rows are renumbered."""
        parts = []
        for var in range(len(self.names)):
            state = states[var] if var in states else self.export(var)
            mine = shard_of(state["keys"], num_shards) == shard_index
            parts.append((var, {k: v[mine] for k, v in state.items() if k != "global_step" and v.dim() > 0}))
        total = sum(int(p["keys"].numel()) for _, p in parts)
        self._allocate(max(1024, 2 * total))
        for var, part in parts:
            n = part["keys"].numel()
            new = slice(self.size, self.size + n)
            self.row_ns[new] = var
            self.row_keys[new] = part["keys"]
            self.weight[new] = part["values"]
            self.freq[new], self.version[new] = part["freq"], part["version"]
            for name, slot in self.slots.items():
                slot[new] = part[f"slot.{name}"]
            self.size += n
        held = self.index.assign(self.row_keys[: self.size], torch.arange(self.size), ns=self.row_ns[: self.size])
        if held != self.size:
            raise ValueError(f"the rows loaded hold {self.size - held} keys twice (a variable's checkpoint "
                             "must hold each key once)")


class DenseGroup:
    """The dense variables of one optimizer: one flat buffer and its slots.

    A push of every variable is one optimizer update over the buffer; a push of some
    of them updates those slices (one optimizer step either way)."""

    def __init__(self, optimizer: sparse.RowSparseOptimizer):
        self.optimizer = optimizer
        self.spans: dict[str, tuple[int, int, list[int]]] = {}  # name -> (offset, numel, shape)
        self.value = torch.zeros(0)
        self.slots = {n: torch.zeros(0) for n, (_, per_element) in optimizer.slot_specs().items() if per_element}
        # a per-row slot (AdamAsync's row step) has one value per variable
        self.row_slots = {n: torch.zeros(0) for n, (_, per_element) in optimizer.slot_specs().items()
                          if not per_element}

    def add(self, name: str, init: torch.Tensor) -> None:
        specs = self.optimizer.slot_specs()
        self.spans[name] = (self.value.numel(), init.numel(), list(init.shape))
        self.value = torch.cat([self.value, init.float().reshape(-1)])
        for n in self.slots:
            self.slots[n] = torch.cat([self.slots[n], torch.full((init.numel(),), specs[n][0])])
        for n in self.row_slots:
            self.row_slots[n] = torch.cat([self.row_slots[n], torch.full((1,), specs[n][0])])

    def memory(self) -> int:
        return 4 * self.value.numel() * (1 + len(self.slots))

    def view(self, name: str, tensor: torch.Tensor | None = None) -> torch.Tensor:
        offset, numel, shape = self.spans[name]
        return (self.value if tensor is None else tensor)[offset:offset + numel].view(shape)

    def apply(self, grads: dict[str, torch.Tensor]) -> None:
        """One optimizer step: the flat buffer at once when every variable is pushed."""
        self.optimizer.begin_step()
        zero = torch.zeros(1, dtype=torch.int64)
        if len(grads) == len(self.spans) and not self.row_slots:
            flat = torch.cat([grads[name].reshape(-1) for name in self.spans]).unsqueeze(0)
            self.optimizer.update(self.value.unsqueeze(0), {n: s.unsqueeze(0) for n, s in self.slots.items()},
                                  zero, flat)
            return
        names = list(self.spans)
        for name, grad in grads.items():
            offset, numel, _ = self.spans[name]
            part = slice(offset, offset + numel)
            slots = {n: s[part].unsqueeze(0) for n, s in self.slots.items()}
            index = names.index(name)
            slots.update({n: s[index:index + 1] for n, s in self.row_slots.items()})
            self.optimizer.update(self.value[part].unsqueeze(0), slots, zero, grad.reshape(1, -1))

    def export(self, name: str) -> dict:
        index = list(self.spans).index(name)
        out = {f"dense/{name}": self.view(name).clone()}
        out.update({f"dense_slot/{name}/{n}": self.view(name, s).clone() for n, s in self.slots.items()})
        out.update({f"dense_slot/{name}/{n}": s[index:index + 1].clone() for n, s in self.row_slots.items()})
        return out

    def slot_numel(self, name: str, slot: str) -> int:
        return 1 if slot in self.row_slots else self.spans[name][1]

    def load(self, name: str, tensors: dict) -> None:
        index = list(self.spans).index(name)
        self.view(name).copy_(tensors[f"dense/{name}"].reshape(self.spans[name][2]))
        for n, s in self.slots.items():
            self.view(name, s).copy_(tensors[f"dense_slot/{name}/{n}"].reshape(self.spans[name][2]))
        for n, s in self.row_slots.items():
            s[index:index + 1] = tensors[f"dense_slot/{name}/{n}"].reshape(1)


def row_bytes(dim: int, optimizer: sparse.RowSparseOptimizer) -> int:
    """A row's bytes in an arena of `dim` and `optimizer`: weight, slots, namespace, key, freq, version."""
    per_element = sum(dim if e else 1 for _, e in optimizer.slot_specs().values())
    return 4 * dim + 4 * per_element + 8 * 4


def load_bytes(dim: int, optimizer: sparse.RowSparseOptimizer, rows: int, reserved: bool) -> int:
    """What `EmbeddingArena.memory` reads after a `load` of `rows` rows (without the defaults)."""
    capacity = max(1024, 2 * rows)
    return (rows if reserved else capacity) * row_bytes(dim, optimizer) + 16 * slots_for(capacity)


def _grown(t: torch.Tensor, capacity: int, live: slice) -> torch.Tensor:
    out = torch.empty((capacity, *t.shape[1:]), dtype=t.dtype)
    out[live] = t[live]
    return out
