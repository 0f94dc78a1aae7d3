"""EmbeddingVariable: a dynamic hash embedding (DeepRec's EV) for unbounded int64 keys.

    keys ──KeyIndex (deeprec/nn/key_index.py: native, no GIL)──> rows ──> weight[rows]
                     └─ unseen key: admission filter, then a new row whose
                        initial value is row key % default_value_dim of a fixed matrix

Without an admission filter (the default), a lookup is one native call that finds or
inserts every key, deduplicates them and counts their frequencies; `lookup_variables`
does it for many variables at once (an EmbeddingCollection's, in one op call).

Rows live in growable tensors (weight, freq, version, dirty, optimizer slots),
all indexed by the same row number, so an optimizer's slots share the key index.
Eviction runs at save time and compacts the rows. A re-entrant lock makes a
save see every row together with its slots (DeepRec issue 1023).

Row numbers held across a compaction (a lookup's rows waiting for their gradient
in backward, while another thread saves) are not trusted: each compaction starts
a new `generation` and keeps the old -> new row map, and an update translates its
rows to the current generation (rows of evicted keys get no update). A lookup
finds its rows and reads their values under one lock hold (`lookup`).

As a layer (`ev(ids)`, an `EmbeddingLookup`) its row gradients are kept until the end of the
backward pass, then merged and applied as one optimizer step: an EV called for two features gets
one update, like a shared table of an EmbeddingCollection (and TensorFlow's sparse apply).
Micro-batching keeps them until the optimizer step (`defer_updates`, `apply_pending`).
Rows in DRAM and on disk: `TieredEmbeddingVariable`, or `embedding_variable(...)`, which picks
the class the option's storage needs.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch

from deeprec.errors import ConfigError
from deeprec.nn.key_index import NO_KEYS, KeyIndex
from deeprec.nn.lookup import EmbeddingLookup, RowGather, merge_rows
from deeprec.nn.options import CBFFilter, CounterFilter, EmbeddingVariableOption, GlobalStepEvict, L2WeightEvict

PARTITION_MOD = 1000  # DeepRec partitions keys by key % 1000 % num_shards
_SAVING = threading.local()


@contextlib.contextmanager
def incremental_state_dict():
    """Inside this block, `state_dict()` holds each EmbeddingVariable's rows touched
    since its last full export instead of all rows (an incremental checkpoint)."""
    previous = getattr(_SAVING, "incremental", False)
    _SAVING.incremental = True
    try:
        yield
    finally:
        _SAVING.incremental = previous


def shard_of(keys: torch.Tensor, num_shards: int) -> torch.Tensor:
    return torch.remainder(torch.remainder(keys, PARTITION_MOD), num_shards)


class Gathered:
    """Adapter so RowGather can `index_select` rows already read (`EmbeddingVariable.lookup`)."""

    def __init__(self, values: torch.Tensor):
        self.values = values

    def index_select(self, dim: int, rows: torch.Tensor) -> torch.Tensor:
        return self.values


MAX_GENERATIONS = 8  # row maps kept: an update older than this many compactions is dropped


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """x >> k of the uint64 whose bits int64 x holds (a logical shift)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64_mod(x: torch.Tensor, salt: int, m: int) -> torch.Tensor:
    """splitmix64's finalizer of (x + salt constant) modulo m, in uint64 arithmetic on int64 bits
    (torch ops, no numpy): the counting Bloom filter's j-th position of each key."""
    x = x + _signed((0x9E3779B97F4A7C15 * (salt + 1)) & 0xFFFFFFFFFFFFFFFF)
    x = (x ^ _shr(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _signed(0x94D049BB133111EB)
    x = x ^ _shr(x, 31)
    # the unsigned value is x + 2^64 where x < 0
    return torch.where(x < 0, torch.remainder(torch.remainder(x, m) + (1 << 64) % m, m), torch.remainder(x, m))


def _grown(t: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=t.dtype)
    out[: t.numel()] = t
    return out


_COUNTERS = frozenset({"size", "global_step"})  # ints set on every step's lookup and update


class EmbeddingVariable(EmbeddingLookup):
    def __setattr__(self, name: str, value) -> None:
        if name in _COUNTERS:  # plain ints: nn.Module.__setattr__'s checks cost ~5 us, 52 times a DLRM step
            self.__dict__[name] = value
        else:
            super().__setattr__(name, value)

    def __init__(self, embedding_dim: int, *, key_dtype: torch.dtype = torch.int64,
                 ev_option: EmbeddingVariableOption | None = None, name: str | None = None,
                 shard_index: int = 0, num_shards: int = 1, initial_capacity: int = 1024):
        super().__init__()
        if ev_option is not None and ev_option.storage.tiered and not self._tiered:
            raise ConfigError(f"EmbeddingVariable{f' {name!r}' if name else ''}: a StorageOption with an ssd tier "
                              "needs dr.nn.TieredEmbeddingVariable(...), or dr.nn.embedding_variable(...), which "
                              "picks the class for the storage")
        if key_dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"key_dtype must be torch.int64 or torch.int32, got {key_dtype}")
        if not 0 <= shard_index < num_shards:
            raise ConfigError(f"shard_index must be in [0, num_shards={num_shards}), got {shard_index}")
        self.embedding_dim, self.key_dtype, self.name = embedding_dim, key_dtype, name
        self.option = ev_option or EmbeddingVariableOption()
        self.shard_index, self.num_shards = shard_index, num_shards
        self._defaults = self.option.init_option.matrix(embedding_dim)
        self._no_permission = float(self.option.init_option.default_value_no_permission)
        self._lock = threading.RLock()
        self._slot_init: dict[str, tuple[float, bool]] = {}  # name -> (initial value, per element)
        self.global_step = 0
        self.optimizer = None  # row-sparse optimizer of ev(ids)'s backward (set_optimizer)
        self._token = torch.zeros(0, requires_grad=True)  # makes autograd call RowGather.backward
        self.generation = 0  # bumped by every compaction or full load (rows renumbered)
        self._row_maps: dict[int, torch.Tensor | None] = {}  # generation g -> row map into g + 1
        self._kept_grads: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (rows, grad, generation) per lookup
        self._deferred = False  # micro-batching: keep the gradients until the optimizer step
        self._apply_queued = False  # an end-of-backward callback will apply the kept gradients
        self._reset(initial_capacity)

    _tiered = False  # TieredEmbeddingVariable: rows in DRAM and on disk

    @property
    def native_path(self) -> bool:
        """No admission filter and every row in DRAM: a lookup is one native find-or-insert call."""
        return self.option.filter_option is None and not self._tiered

    # -- copies (copy.deepcopy, pickle): the lock is made anew (the key indexes are tensors) ---
    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._lock = threading.RLock()

    # -- as a layer: ev(ids), like nn.Embedding ------------------------------------------------
    def set_optimizer(self, optimizer) -> None:
        """The row-sparse optimizer (deeprec.optim.Adagrad, Adam, ...) that ev(ids)'s backward applies
        to the rows looked up; `deeprec.optim.make_optimizer(model)` attaches one to every free
        EmbeddingVariable (those of an EmbeddingCollection get the collection's)."""
        self.optimizer = optimizer
        self.attach_slots(optimizer.slot_specs())

    def forward(self, ids) -> torch.Tensor:
        """Rows of int ids of any shape -> [*ids.shape, dim], differentiable. In training, new keys
        are inserted (filters permitting); an id seen several times in one call is looked up
        once, its gradients summed, and its row updated once by the attached optimizer."""
        ids = torch.as_tensor(ids)
        flat = ids.reshape(-1).to(torch.int64).cpu()  # a host table
        if self._kept_grads and not self._deferred and self.training:
            self.check_applied()
        if self.native_path:  # one native call: dedup, find or insert, count, gather
            values, [(rows, generation, inverse)] = _native_lookup([self], [flat.contiguous()], [None],
                                                                   self.training, dedup=True)
        else:
            keys, inverse, counts = torch.unique(flat, return_inverse=True, return_counts=True)
            rows, values, generation = self.lookup(keys, counts, train=self.training)
        inverse = inverse.to(ids.device)
        if self.training and torch.is_grad_enabled():
            values = RowGather.apply(self._token, Gathered(values), rows,
                                     functools.partial(self._receive, generation=generation))
        values = values.to(ids.device)  # differentiable: gradients come back to the host rows
        return values[inverse].reshape(*ids.shape, self.embedding_dim)

    def lookup(self, keys: torch.Tensor, counts: torch.Tensor | None = None, train: bool = True):
        """(rows, their values, generation) of `keys`, found and read under one lock hold, so
        a concurrent save's compaction cannot move the rows in between."""
        if self.native_path:
            values, [(rows, generation, _)] = _native_lookup([self], [keys.to(torch.int64).contiguous()], [counts],
                                                             train, dedup=False)
            return rows, values, generation
        with self._lock:
            rows = self.rows_for(keys, counts, train=train)
            return rows, self.gather(rows), self.generation

    def _receive(self, rows: torch.Tensor, grad: torch.Tensor, generation: int | None = None) -> None:
        if self.optimizer is None:
            named = f" {self.name!r}" if self.name else ""
            raise RuntimeError(f"EmbeddingVariable{named} got a gradient but has no row-sparse optimizer: "
                               "ev.set_optimizer(deeprec.optim.Adagrad(lr=...)) or deeprec.optim.make_optimizer(model)")
        self._kept_grads.append((rows, grad, generation))
        if not self._deferred and not self._apply_queued:  # once all of this backward's lookups are in
            self._apply_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._apply_after_backward)

    def _apply_after_backward(self) -> None:
        self._apply_queued = False
        if not self._deferred:
            self.apply_pending()

    # -- EmbeddingLookup -----------------------------------------------------------------
    @property
    def updates_in_backward(self) -> bool:
        return self.optimizer is not None and not self._deferred

    def defer_updates(self, defer: bool) -> None:
        self._deferred = defer

    @property
    def has_pending(self) -> bool:
        return bool(self._kept_grads)

    def apply_pending(self) -> None:
        """The gradients of every lookup since the last update: rows renumbered to the current
        generation, merged (a row looked up twice gets the sum), one optimizer step."""
        if not self._kept_grads:
            return
        with self._lock:
            pending, self._kept_grads = self._kept_grads, []
            rows = torch.cat([self.current_rows(r, g) for r, _, g in pending])
            rows, grad = merge_rows(rows, torch.cat([g for _, g, _ in pending]))
            self.optimizer.begin_step()
            self.global_step = self.optimizer.step_count
            self.apply_update(self.optimizer, rows, grad, self.generation)

    def discard_pending(self) -> None:
        self._kept_grads.clear()

    @property
    def can_prefetch(self) -> bool:
        return False  # all rows are in DRAM already

    # -- storage ------------------------------------------------------------------------
    def _reset(self, capacity: int) -> None:
        capacity = max(capacity, 16)
        self._index = KeyIndex(capacity)
        self.size = 0
        self.keys = torch.empty(capacity, dtype=torch.int64)
        self.weight = torch.empty(capacity, self.embedding_dim)
        self.freq = torch.zeros(capacity, dtype=torch.int64)
        self.version = torch.zeros(capacity, dtype=torch.int64)
        self.dirty = torch.zeros(capacity, dtype=torch.bool)
        self.slots = {name: self._new_slot(name, capacity) for name in self._slot_init}
        f = self.option.filter_option
        self._pending_index = KeyIndex() if isinstance(f, CounterFilter) else None
        self._pending_counts = torch.zeros(0, dtype=torch.int64)
        self._pending_keys = torch.zeros(0, dtype=torch.int64)  # kept so the index can be rebuilt (copies)
        self._pending_size = 0
        if isinstance(f, CBFFilter):
            m, self._cbf_hashes = f.sizing()
            self._cbf = torch.zeros(m, dtype=f.counter_type)

    def _new_slot(self, name: str, rows: int) -> torch.Tensor:
        value, per_element = self._slot_init[name]
        shape = (rows, self.embedding_dim) if per_element else (rows,)
        return torch.full(shape, value)

    @property
    def capacity(self) -> int:
        return self.keys.numel()

    def attach_slots(self, slots: dict[str, tuple[float, bool]]) -> None:
        """Declare optimizer state rows: {name: (initial value, per element?)}."""
        with self._lock:
            for name, spec in slots.items():
                self._slot_init[name] = spec
                fresh = self._new_slot(name, self.capacity)
                old = self.slots.get(name)
                if old is not None and old.shape == fresh.shape:
                    fresh[: self.size] = old[: self.size]
                self.slots[name] = fresh

    def _grow(self, needed: int) -> None:
        capacity = self.capacity
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity)

        def grown(t: torch.Tensor, fill=None) -> torch.Tensor:
            out = (torch.empty if fill is None else torch.zeros)((new_capacity, *t.shape[1:]), dtype=t.dtype)
            out[: self.size] = t[: self.size]
            return out

        self.keys, self.weight = grown(self.keys), grown(self.weight)
        self.freq, self.version, self.dirty = grown(self.freq, 0), grown(self.version, 0), grown(self.dirty, 0)
        for name, slot in self.slots.items():
            fresh = self._new_slot(name, new_capacity)  # new rows start at the slot's initial value
            fresh[: self.size] = slot[: self.size]
            self.slots[name] = fresh

    def _new_rows(self, n: int) -> tuple[torch.Tensor, slice | torch.Tensor]:
        """n free rows, as a tensor and as what indexes them fastest (new rows are contiguous here:
        a slice; a tiered variable reuses rows), their optimizer slots at their initial values."""
        self._grow(self.size + n)
        return torch.arange(self.size, self.size + n, dtype=torch.int64), slice(self.size, self.size + n)

    def _insert(self, keys: torch.Tensor) -> torch.Tensor:
        n = keys.numel()
        rows, new = self._new_rows(n)
        self.keys[new] = keys
        self.weight[new] = torch.index_select(self._defaults, 0, torch.remainder(keys, self._defaults.shape[0]))
        self.freq[new] = 0
        self.version[new] = self.global_step
        self.dirty[new] = True
        self._index.assign(keys, rows)
        self.size += n
        return rows

    # -- admission -----------------------------------------------------------------------
    def _admit(self, keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Which of these new keys (with their sightings this call) may get a row."""
        f = self.option.filter_option
        if f is None:
            return torch.ones(keys.numel(), dtype=torch.bool)
        if isinstance(f, CounterFilter):
            slots = self._pending_index.lookup(keys)
            new = slots < 0
            if new.any():
                n_new = int(new.sum())
                fresh = torch.arange(self._pending_size, self._pending_size + n_new, dtype=torch.int64)
                self._pending_index.assign(keys[new], fresh)
                self._pending_size += n_new
                if self._pending_size > self._pending_counts.numel():
                    size = max(self._pending_size, 2 * self._pending_counts.numel())
                    self._pending_counts = _grown(self._pending_counts, size)
                    self._pending_keys = _grown(self._pending_keys, size)
                self._pending_keys[fresh] = keys[new]
                slots[new] = fresh
            self._pending_counts.index_add_(0, slots, counts)
            return self._pending_counts[slots] >= f.filter_freq
        positions = torch.stack([_mix64_mod(keys, j, self._cbf.numel()) for j in range(self._cbf_hashes)])
        for j in range(self._cbf_hashes):
            self._cbf.index_add_(0, positions[j], counts.to(self._cbf.dtype))
        return self._cbf[positions].min(dim=0).values >= f.filter_freq

    def rows_for(self, keys: torch.Tensor, counts: torch.Tensor | None = None, train: bool = True) -> torch.Tensor:
        """Rows of `keys` (-1: not admitted or, outside training, unknown); a key given
        twice gets one row.

        In training, counts the sightings and inserts admitted new keys."""
        keys = keys.to(torch.int64)
        with self._lock:
            return self._complete_rows(keys, self._index.lookup(keys), counts, train)

    def _complete_rows(self, keys: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor | None,
                       train: bool) -> torch.Tensor:
        """rows_for's work once the index gave `rows` (-1: not held): admit, insert, count."""
        with self._lock:
            if not train:
                return rows
            counts = torch.ones_like(keys) if counts is None else counts.to(torch.int64)
            missing = rows < 0
            if missing.any():
                where = torch.nonzero(missing).squeeze(1)
                new_keys, repeat = torch.unique(keys[where], return_inverse=True)
                if new_keys.numel() == where.numel():  # distinct: insert in order of first sight
                    admitted = self._admit(keys[where], counts[where])
                    if admitted.any():
                        rows[where[admitted]] = self._insert(keys[where[admitted]])
                else:  # a new key given more than once: one admission decision and one row
                    new_counts = torch.zeros(new_keys.numel(), dtype=torch.int64).index_add_(0, repeat, counts[where])
                    admitted = self._admit(new_keys, new_counts)
                    new_rows = torch.full((new_keys.numel(),), -1, dtype=torch.int64)
                    if admitted.any():
                        new_rows[admitted] = self._insert(new_keys[admitted])
                    rows[where] = new_rows[repeat]
            known = rows >= 0
            self.freq.index_add_(0, rows[known], counts[known])
            return rows

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """weight[rows]; rows < 0 read default_value_no_permission."""
        out = self.weight.index_select(0, rows.clamp_min(0))
        missing = rows < 0
        if missing.any():
            out[missing] = self._no_permission
        return out

    def current_rows(self, rows: torch.Tensor, generation: int | None) -> torch.Tensor:
        """Rows of generation `generation` renumbered into the current one (-1: evicted since,
        or too many compactions ago to tell). Call under the lock."""
        if generation is None or generation == self.generation:
            return rows
        for g in range(generation, self.generation):
            row_map = self._row_maps.get(g)
            if row_map is None:  # a full load, or a map no longer kept: the rows mean nothing now
                return torch.full_like(rows, -1)
            rows = torch.where(rows >= 0, row_map[rows.clamp_min(0)], rows)
        return rows

    def _new_generation(self, row_map: torch.Tensor | None) -> None:
        self._row_maps[self.generation] = row_map
        self._row_maps.pop(self.generation - MAX_GENERATIONS, None)
        self.generation += 1

    def apply_update(self, optimizer, rows: torch.Tensor, grad: torch.Tensor, generation: int | None = None) -> None:
        """Row-sparse update of admitted rows (of `generation`, renumbered if rows moved since);
        keys not admitted, or evicted since the lookup, receive none."""
        with self._lock:
            rows = self.current_rows(rows, generation)
            if bool((rows < 0).any()):
                keep = rows >= 0
                rows, grad = rows[keep], grad[keep]
            optimizer.update(self.weight, self.slots, rows, grad)
            self.version.index_fill_(0, rows, self.global_step)
            self.dirty.index_fill_(0, rows, True)

    # -- eviction and checkpoints ------------------------------------------------------
    def evict(self) -> int:
        """Apply the evict option now; returns how many keys were dropped."""
        policy = self.option.evict_option
        if policy is None:
            return 0
        with self._lock:
            live = slice(0, self.size)
            if isinstance(policy, GlobalStepEvict):
                keep = self.version[live] > self.global_step - policy.steps_to_live
            elif isinstance(policy, L2WeightEvict):
                keep = 0.5 * self.weight[live].pow(2).sum(1) >= policy.l2_weight_threshold
            else:
                raise ConfigError(f"unknown evict_option {policy!r}")
            dropped = int((~keep).sum())
            if dropped:
                kept = torch.nonzero(keep).squeeze(1)
                row_map = torch.full((self.size,), -1, dtype=torch.int64)
                row_map[kept] = torch.arange(kept.numel())  # _load_rows inserts the kept keys in order
                self._load_rows(self._rows_state(kept), row_map=row_map)
            return dropped

    def _rows_state(self, rows: torch.Tensor) -> dict:
        state = {"keys": self.keys[rows].clone(), "values": self.weight[rows].clone(),
                 "freq": self.freq[rows].clone(), "version": self.version[rows].clone()}
        state.update({f"slot.{name}": slot[rows].clone() for name, slot in self.slots.items()})
        return state

    def snapshot(self, after_version: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of every row, or of the rows updated after step `after_version`, copied
        under the lock with no side effect (serving reads them; a checkpoint uses `export`)."""
        with self._lock:
            live = torch.arange(self.size)
            if after_version is not None:
                live = live[self.version[: self.size] > after_version]
            return self.keys[live].clone(), self.weight[live].clone()

    def export(self, incremental: bool = False) -> dict:
        """Keys, values, slots, frequencies and versions of every row (or only the
        rows touched since the last full export), copied together under the lock."""
        with self._lock:
            if not incremental:
                self.evict()
            live = torch.arange(self.size)
            rows = live[self.dirty[: self.size]] if incremental else live
            state = self._rows_state(rows)
            state["global_step"] = torch.tensor(self.global_step)
            state["incremental"] = torch.tensor(incremental)
            if not incremental:
                self.dirty[: self.size] = False
            return state

    def _load_rows(self, state: dict, merge: bool = False, row_map: torch.Tensor | None = None) -> None:
        keys = state["keys"].to(torch.int64)
        mine = shard_of(keys, self.num_shards) == self.shard_index
        pick = {k: v[mine] for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        if not merge:  # rows are renumbered: held rows translate through row_map (or go stale)
            self._reset(max(16, 2 * int(mine.sum())))  # keeps the declared slots, at their initial values
            self._new_generation(row_map)
        keys = pick["keys"]
        rows = self._index.lookup(keys)
        new = rows < 0
        if new.any():
            rows[new] = self._insert(keys[new])
        self.weight[rows] = pick["values"]
        self.freq[rows] = pick["freq"]
        self.version[rows] = pick["version"]
        self.dirty[rows] = False
        for name, slot in self.slots.items():
            if f"slot.{name}" in pick:
                slot[rows] = pick[f"slot.{name}"]

    def load(self, state: dict) -> None:
        """Restore a full export (keeping this shard's keys), or merge an incremental one."""
        with self._lock:
            self._load_rows(state, merge=bool(state.get("incremental", torch.tensor(False))))
            self.global_step = int(state["global_step"])

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for key, value in self.export(incremental=getattr(_SAVING, "incremental", False)).items():
            destination[prefix + key] = value
        if self.optimizer is not None:  # ev(ids)'s own optimizer: its step count (Adam's bias correction)
            destination[prefix + "optimizer_step"] = torch.tensor(self.optimizer.step_count)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix) and "." not in
                k[len(prefix):].replace("slot.", "", 1)}
        if "keys" not in mine:
            missing_keys.append(prefix + "keys")
            return
        self.load(mine)
        if "optimizer_step" in mine and self.optimizer is not None:
            self.optimizer.load_state_dict({"step_count": int(mine["optimizer_step"])})

    def extra_repr(self) -> str:
        return f"dim={self.embedding_dim}, keys={self.size}, shard={self.shard_index}/{self.num_shards}"

    def bytes_per_row(self) -> float:
        """Memory of one key's row: value, key, freq, version, dirty, slots, index share."""
        per_row = (self.embedding_dim * 4 + 8 + 8 + 8 + 1
                   + sum(s[0].numel() * s.element_size() for s in self.slots.values()))
        return per_row + self._index.nbytes() / max(self.size, 1)


@contextlib.contextmanager
def _locked(evs: list[EmbeddingVariable]):
    """Every variable's lock held (taken in list order, released in reverse) inside the block. Plain
    acquire/release: an ExitStack cost ~4 us a lock, twice a step for each of DLRM's 26 variables."""
    taken = 0
    try:
        for ev in evs:
            ev._lock.acquire()
            taken += 1
        yield
    finally:
        for ev in reversed(evs[:taken]):
            ev._lock.release()


def _native_lookup(evs: list[EmbeddingVariable], keys: list[torch.Tensor], counts: list, train: bool, dedup: bool):
    """(values [places of all variables, dim], [(rows, generation, inverse)] per variable) of variables on
    the native path, in one op call with every variable's lock held (deeprec/csrc/ev_lookup.cpp): keys
    found or (in training) inserted with their initial values, frequencies counted, rows gathered."""
    with _locked(evs):
        if train:  # room for every key to be new
            for ev, part in zip(evs, keys):
                ev._grow(ev.size + part.numel())
                ev._index.reserve(part.numel())
        values, rows, inverse, stats = torch.ops.deeprec.ev_lookup(
            [ev._index.table for ev in evs], [ev.keys for ev in evs], [ev.freq for ev in evs],
            [ev.weight for ev in evs], [ev.version for ev in evs], [ev.dirty for ev in evs],
            [ev._defaults for ev in evs], keys, [NO_KEYS if c is None else c.to(torch.int64).contiguous() for c in counts],
            [ev.size for ev in evs], [ev.global_step for ev in evs], [ev._no_permission for ev in evs], train, dedup)
        if train:
            for ev, created in zip(evs, stats[:, 3].tolist()):
                ev.size += created
                ev._index.entries += created
        return values, [(r, ev.generation, i) for ev, r, i in zip(evs, rows, inverse)]


def lookup_variables(evs: list[EmbeddingVariable], keys: list[torch.Tensor], counts: list, train: bool):
    """(values [every variable's keys, dim], [(rows, generation)] per variable) of each variable's keys
    (distinct per variable): one native call when every variable is on the native path, else each
    variable's own lookup (admission filters, tiers)."""
    keys = [k.to(torch.int64).contiguous() for k in keys]
    if all(ev.native_path for ev in evs) and len({id(ev) for ev in evs}) == len(evs):
        values, found = _native_lookup(evs, keys, counts, train, dedup=False)
        return values, [(rows, generation) for rows, generation, _ in found]
    found = [ev.lookup(k, c, train=train) for ev, k, c in zip(evs, keys, counts)]
    return torch.cat([values for _, values, _ in found]), [(rows, generation) for rows, _, generation in found]


def apply_variables(optimizer, evs: list[EmbeddingVariable], found: list, grad: torch.Tensor) -> bool:
    """One optimizer step over the rows [(rows, generation)] of many variables' lookup (grad: their
    rows in order), in one op call (deeprec::ev_apply_) that also stamps each row's version and
    dirty flag. Returns False, doing nothing, where it cannot: a variable off the native path or
    given twice, rows renumbered since the lookup, or an optimizer without a fused kernel."""
    spec = optimizer.fused()
    if spec is None or not all(ev.native_path for ev in evs) or len({id(ev) for ev in evs}) < len(evs):
        return False
    kind, slot_names, hyper = spec
    with _locked(evs):
        if any(ev.generation != generation for ev, (_, generation) in zip(evs, found)):
            return False
        optimizer.begin_step()
        for ev in evs:
            ev.global_step = optimizer.step_count
        torch.ops.deeprec.ev_apply_(kind, [ev.weight for ev in evs], [ev.slots[n] for ev in evs for n in slot_names],
                                    [ev.version for ev in evs], [ev.dirty for ev in evs], [r for r, _ in found],
                                    grad.contiguous(), hyper, optimizer.step_count)
        return True
