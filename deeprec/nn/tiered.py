"""Multi-tier EmbeddingVariable (DeepRec's DRAM + SSDHASH storage): hot rows in a bounded
DRAM cache, the others on disk.

    keys ──cache index──> cache row: weight, slots, freq, version, dirty   (at most dram_bytes)
      └─ not in DRAM ──disk index──> disk slot ──one batched read──> promoted into DRAM
    DRAM full ──victims: least frequently (lfu) / recently (lru) used, never a row of the
                last `protect_steps` lookups──> one batched write-back of rows and slots

A key lives in exactly one tier, so no copy is ever stale. Only placement differs from
an all-DRAM EmbeddingVariable: a lookup reads the same values, and an update re-finds
its keys (a row may have gone to disk and back since the lookup, e.g. when SmartStage
promoted the next batch's rows) and lands on the same key's row. Results are equal.
"""
from __future__ import annotations

import copy
import dataclasses
import tempfile

import torch

from deeprec.errors import ConfigError, StorageFullError
from deeprec.nn.disk_rows import DiskRows
from deeprec.nn.options import EmbeddingVariableOption, GlobalStepEvict, L2WeightEvict, StorageOption
from deeprec.nn.key_index import KeyIndex
from deeprec.nn.shared import replace_module
from deeprec.nn.variable import EmbeddingVariable, shard_of

_MIN_CACHE_ROWS = 16


@dataclasses.dataclass
class _Held:
    """What an update needs to find its rows again: the keys looked up and which got a row."""
    keys: torch.Tensor
    admitted: torch.Tensor
    generation: int
    moves: int  # the variable's count of rows that left DRAM, at the lookup


class TieredEmbeddingVariable(EmbeddingVariable):
    """An EmbeddingVariable whose `ev_option.storage` has an ssd tier (`dr.nn.embedding_variable(...)` picks
    this class for such a storage)."""

    _tiered = True

    @property
    def can_prefetch(self) -> bool:
        return self.option.storage.prefetch

    def prefetch(self, keys, train: bool) -> None:
        """SmartStage's stage: the staged keys' rows promoted into DRAM for the next lookup."""
        self.prefetch_rows(torch.as_tensor(keys).reshape(-1).cpu())

    # -- storage ---------------------------------------------------------------------------
    def _reset(self, capacity: int) -> None:
        storage = self.option.storage
        self.stats = dict(getattr(self, "stats", None) or dict.fromkeys(
            ("lookups", "hits", "disk_reads", "prefetched", "prefetch_skipped", "disk_writes", "bytes_read",
             "bytes_written"), 0))
        super()._reset(self._cache_rows())
        cache = self.capacity
        self.last_used = torch.zeros(cache, dtype=torch.int64)  # the lookup ("tick") that last used a row
        self.occupied = torch.zeros(cache, dtype=torch.bool)
        self.staged = torch.zeros(cache, dtype=torch.bool)  # promoted by a prefetch, not looked up since
        self._free = torch.arange(cache - 1, -1, -1, dtype=torch.int64)  # a stack: rows 0, 1, ... first
        self._tick = getattr(self, "_tick", 0)
        self._moves = getattr(self, "_moves", 0) + 1  # rows that left DRAM (held rows may be stale)
        if getattr(self, "disk", None) is not None:
            self.disk.close()
        self.disk = DiskRows(storage.path or tempfile.gettempdir(), self.name or "ev", self._disk_width())
        self._disk_index = KeyIndex()

    def _row_bytes(self) -> int:
        """DRAM bytes of one cached row: value and slots, key, freq, version, last use, three flags."""
        return 4 * self._disk_width() + 8 * 4 + 3

    def _cache_rows(self) -> int:
        return max(_MIN_CACHE_ROWS, self.option.storage.dram_bytes // self._row_bytes())

    def _disk_width(self) -> int:
        """Floats of a row's record: its value, then each optimizer slot."""
        return self.embedding_dim + sum(self.embedding_dim if e else 1 for _, e in self._slot_init.values())

    def _grow(self, needed: int) -> None:
        raise AssertionError("a tiered EmbeddingVariable's DRAM cache never grows")  # _new_rows evicts instead

    def attach_slots(self, slots: dict[str, tuple[float, bool]]) -> None:
        with self._lock:
            if self.disk.rows and any(name not in self._slot_init for name in slots):
                raise ConfigError(f"EmbeddingVariable {self.name!r}: attach the optimizer before rows are loaded "
                                  "onto its disk tier (its records have no room for new optimizer slots)")
            super().attach_slots(slots)
            if self.disk.size == 0:  # records with room for the slots
                self.disk.close()
                self.disk = DiskRows(self.disk.directory, self.name or "ev", self._disk_width())
            fits = self._cache_rows()
            if fits < self.capacity:  # the slots take DRAM too: fewer rows fit the budget
                self._write_back(torch.nonzero(self.occupied[fits:]).squeeze(1) + fits)
                self._shrink_cache(fits)

    def _shrink_cache(self, rows: int) -> None:
        self._moves += 1
        for name in ("keys", "weight", "freq", "version", "dirty", "last_used", "occupied", "staged"):
            setattr(self, name, getattr(self, name)[:rows].clone())
        self.slots = {name: slot[:rows].clone() for name, slot in self.slots.items()}
        self._free = torch.nonzero(~self.occupied).squeeze(1).flip(0)

    # -- moving rows between the tiers -------------------------------------------------------
    def _new_rows(self, n: int):
        rows = self._take_rows(n)
        for name, slot in self.slots.items():  # a reused row starts over
            slot[rows] = self._slot_init[name][0]
        self.occupied[rows] = True
        self.last_used[rows] = self._tick
        return rows, rows

    def _take_rows(self, n: int) -> torch.Tensor:
        if self._free.numel() < n:
            # evict a slice of the cache at once: the victim scan is over every row
            self._evict_for(n - self._free.numel(), extra=self.capacity // 16)
        rows = self._free[self._free.numel() - n:]
        self._free = self._free[: self._free.numel() - n]
        return rows

    def _evict_for(self, needed: int, extra: int) -> None:
        protected = self.last_used > self._tick - self.option.storage.protect_steps
        candidates = self.occupied & ~protected
        # rows a prefetch promoted for a later batch go only when nothing else can: a prefetch
        # never makes a lookup fail
        spare = self.occupied & protected & self.staged
        regular = int(candidates.sum())
        available = regular + int(spare.sum())
        if available < needed:
            raise ConfigError(
                f"EmbeddingVariable {self.name!r}: StorageOption.dram_bytes={self.option.storage.dram_bytes} holds "
                f"{self.capacity} rows, too few for the rows of the last {self.option.storage.protect_steps} lookups "
                f"plus {needed} more: raise dram_bytes (or lower protect_steps)")
        score = (self.freq if self.option.storage.cache == "lfu" else self.last_used).clone()
        score[~candidates] = torch.iinfo(torch.int64).max
        score[spare] = torch.iinfo(torch.int64).max - 1
        victims = torch.topk(score, max(needed, min(regular, needed + extra)), largest=False, sorted=False).indices
        self._write_back(victims)

    def _write_back(self, rows: torch.Tensor) -> None:
        """Rows (with their slots, freq, version, dirty flag) from DRAM to disk, in one batch."""
        if not rows.numel():
            return
        keys = self.keys[rows]
        slots = self.disk.allocate(rows.numel())
        self.disk.write(slots, self._floats(rows), keys, self.freq[rows], self.version[rows], self.dirty[rows])
        self._disk_index.assign(keys, slots)
        self._index.remove(keys)
        self._free_rows(rows)
        self.stats["disk_writes"] += rows.numel()
        self.stats["bytes_written"] += rows.numel() * self.disk.record_bytes

    def _free_rows(self, rows: torch.Tensor) -> None:
        """DRAM rows whose keys left (to disk, or evicted): back on the free stack. A lookup's
        rows held since may now be another key's: `_moves` tells an update to find its keys again."""
        self.occupied[rows] = False
        self.staged[rows] = False
        self._free = torch.cat([self._free, rows])
        self.size -= rows.numel()
        self._moves += 1

    def _floats(self, rows: torch.Tensor) -> torch.Tensor:
        parts = [self.weight[rows]] + [slot[rows].reshape(rows.numel(), -1) for slot in self.slots.values()]
        return torch.cat(parts, 1)

    def _float_parts(self, floats: torch.Tensor) -> dict[str, torch.Tensor]:
        """A record's floats split back (views): "values" [n, dim] and "slot.NAME" in the slot's shape."""
        parts, offset = {"values": floats[:, : self.embedding_dim]}, self.embedding_dim
        for name, slot in self.slots.items():
            width = self.embedding_dim if slot.dim() == 2 else 1
            parts[f"slot.{name}"] = floats[:, offset:offset + width].reshape(-1, *slot.shape[1:])
            offset += width
        return parts

    def _set_floats(self, rows, floats: torch.Tensor) -> None:
        for name, part in self._float_parts(floats).items():
            target = self.weight if name == "values" else self.slots[name[len("slot."):]]
            target[rows] = part

    def _promote(self, keys: torch.Tensor, staged: bool = False) -> int:
        """Move the keys held on disk (of these distinct keys, none in DRAM) into DRAM; returns how many.
        `staged`: for a later batch (a prefetch). Raises ConfigError, changing nothing, if DRAM has no room."""
        slots = self._disk_index.lookup(keys)
        on_disk = slots >= 0
        if not bool(on_disk.any()):
            return 0
        keys, slots = keys[on_disk], slots[on_disk]
        floats, ints = self.disk.read(slots)  # one batched read
        dirty = self.disk.dirty[slots]
        rows = self._take_rows(keys.numel())
        self._set_floats(rows, floats)
        self.keys[rows], self.freq[rows], self.version[rows] = keys, ints[:, 1], ints[:, 2]
        self.dirty[rows] = dirty
        self.occupied[rows] = True
        self.staged[rows] = staged
        self.last_used[rows] = self._tick
        self._index.assign(keys, rows)
        self._disk_index.remove(keys)
        self.disk.release(slots)
        self.size += keys.numel()
        self.stats["bytes_read"] += keys.numel() * self.disk.record_bytes
        return keys.numel()

    def _make_resident(self, keys: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """Protect the keys' DRAM rows and promote those on disk; (their rows, -1 where still
        not held; how many were read from disk). `rows`: the index's answer, if already known."""
        if rows is None:
            rows = self._index.lookup(keys)
        resident = rows >= 0
        if bool(resident.all()):  # the common case: every row in DRAM
            self.last_used[rows] = self._tick
            self.staged[rows] = False
            return rows, 0
        self.last_used[rows[resident]] = self._tick  # before promotions evict anything
        self.staged[rows[resident]] = False
        read = self._promote(torch.unique(keys[~resident]))  # promoted rows are stamped with the tick
        if read:
            rows = self._index.lookup(keys)
        return rows, read

    # -- lookups and updates -------------------------------------------------------------------
    def rows_for(self, keys: torch.Tensor, counts: torch.Tensor | None = None, train: bool = True) -> torch.Tensor:
        keys = keys.to(torch.int64)
        with self._lock:
            self._tick += 1
            rows = self._index.lookup(keys)
            hits = int((rows >= 0).sum())
            if hits < keys.numel():
                rows, read = self._make_resident(keys, rows)
                self.stats["disk_reads"] += read
            else:
                self.last_used[rows] = self._tick
                self.staged[rows] = False
            self.stats["lookups"] += keys.numel()
            self.stats["hits"] += hits
            # admission and inserts (_new_rows evicts, and stamps new rows with the tick)
            return self._complete_rows(keys, rows, counts, train)

    def lookup(self, keys: torch.Tensor, counts: torch.Tensor | None = None, train: bool = True):
        with self._lock:
            rows = self.rows_for(keys, counts, train=train)
            return rows, self.gather(rows), _Held(keys.to(torch.int64), rows >= 0, self.generation, self._moves)

    def prefetch_rows(self, keys: torch.Tensor) -> None:
        """Promote the keys' rows from disk into DRAM (SmartStage's stage, for the next batch)."""
        if not self.disk.rows:  # a table that fits DRAM: nothing to promote (no lock, no lookup)
            return
        keys = keys.to(torch.int64)
        with self._lock:
            rows = self._index.lookup(keys)
            missing = rows < 0
            if bool(missing.any()):
                try:
                    self.stats["prefetched"] += self._promote(torch.unique(keys[missing]), staged=True)
                except (ConfigError, StorageFullError):  # no room now: the lookup will read them from disk
                    self.stats["prefetch_skipped"] += 1

    def current_rows(self, rows: torch.Tensor, generation) -> torch.Tensor:
        """The current DRAM rows of a lookup's keys (promoted again if they went to disk since)."""
        if not isinstance(generation, _Held):
            return super().current_rows(rows, generation)
        if generation.generation != self.generation:  # a full load since: the rows mean nothing now
            return torch.full_like(rows, -1)
        if generation.moves == self._moves:  # no row left DRAM since the lookup: the rows still hold
            return rows
        # no new tick: rows found for one update (apply_pending finds several lookups' rows
        # before it applies them) stay protected from each other's promotions
        found, _ = self._make_resident(generation.keys)
        return torch.where(generation.admitted, found, -1)  # not admitted at lookup: no update, as in DRAM

    # -- eviction policies, checkpoints -------------------------------------------------------
    def _disk_state(self, slots: torch.Tensor) -> dict:
        floats, ints = self.disk.read(slots)
        state = {"keys": ints[:, 0], "freq": ints[:, 1], "version": ints[:, 2]}
        state.update({name: part.clone() for name, part in self._float_parts(floats).items()})
        return state

    def _state(self, dirty_only: bool = False) -> dict:
        """Every row of both tiers (or those changed since the last full export), no side effect."""
        mask = self.occupied & self.dirty if dirty_only else self.occupied
        cached = self._rows_state(torch.nonzero(mask).squeeze(1))
        on_disk = self._disk_state(self.disk.live(dirty_only))
        return {k: torch.cat([cached[k], on_disk[k]]) for k in cached}

    def export(self, incremental: bool = False) -> dict:
        with self._lock:
            if not incremental:
                self.evict()
            state = self._state(dirty_only=incremental)
            state["global_step"] = torch.tensor(self.global_step)
            state["incremental"] = torch.tensor(incremental)
            if not incremental:
                self.dirty[:] = False
                self.disk.dirty[:] = False
            return state

    def snapshot(self, after_version: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            state = self._state()
        keep = slice(None) if after_version is None else state["version"] > after_version
        return state["keys"][keep], state["values"][keep]

    def evict(self) -> int:
        policy = self.option.evict_option
        if policy is None:
            return 0
        with self._lock:
            cache_rows, disk_slots = torch.nonzero(self.occupied).squeeze(1), self.disk.live()
            if isinstance(policy, GlobalStepEvict):
                limit = self.global_step - policy.steps_to_live
                drop_cache = cache_rows[self.version[cache_rows] <= limit]
                drop_disk = disk_slots[self.disk.read(disk_slots)[1][:, 2] <= limit]
            elif isinstance(policy, L2WeightEvict):
                def low(values):
                    return 0.5 * values.pow(2).sum(1) < policy.l2_weight_threshold
                drop_cache = cache_rows[low(self.weight[cache_rows])]
                drop_disk = disk_slots[low(self.disk.read(disk_slots)[0][:, : self.embedding_dim])]
            else:
                raise ConfigError(f"unknown evict_option {policy!r}")
            self._index.remove(self.keys[drop_cache])
            self._disk_index.remove(self.disk.ints[drop_disk, 0])
            self._free_rows(drop_cache)
            self.disk.release(drop_disk)
            return drop_cache.numel() + drop_disk.numel()

    def _load_rows(self, state: dict, merge: bool = False, row_map=None) -> None:
        keys = state["keys"].to(torch.int64)
        mine = shard_of(keys, self.num_shards) == self.shard_index
        pick = {k: v[mine] for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        keys = pick["keys"]
        if not merge:
            self._reset(self.capacity)
            self._new_generation(None)
        floats = torch.cat([pick["values"]] + [
            pick.get(f"slot.{n}", torch.full_like(s[:1], self._slot_init[n][0]).expand(keys.numel(), *s.shape[1:]))
            .reshape(keys.numel(), -1) for n, s in self.slots.items()], 1)
        clean = torch.zeros(keys.numel(), dtype=torch.bool)
        rows = self._index.lookup(keys)
        slots = self._disk_index.lookup(keys)
        cached, on_disk = rows >= 0, (rows < 0) & (slots >= 0)
        new = torch.nonzero((rows < 0) & (slots < 0)).squeeze(1)
        into_dram = new[: min(new.numel(), self._free.numel())]  # free DRAM first, the rest to disk
        to_disk = new[into_dram.numel():]
        if to_disk.numel():  # first: a disk tier with no room (StorageFullError) changes no row
            slots[to_disk] = self.disk.allocate(to_disk.numel())
            self._disk_index.assign(keys[to_disk], slots[to_disk])
            on_disk[to_disk] = True
        if into_dram.numel():
            rows[into_dram] = self._take_rows(into_dram.numel())
            self.occupied[rows[into_dram]] = True
            self.last_used[rows[into_dram]] = self._tick - self.option.storage.protect_steps  # evictable
            self._index.assign(keys[into_dram], rows[into_dram])
            self.size += into_dram.numel()
            cached[into_dram] = True
        r = rows[cached]
        self.keys[r], self.freq[r], self.version[r], self.dirty[r] = keys[cached], pick["freq"][cached], \
            pick["version"][cached], False
        self._set_floats(r, floats[cached])
        self.disk.write(slots[on_disk], floats[on_disk], keys[on_disk], pick["freq"][on_disk],
                        pick["version"][on_disk], clean[on_disk])

    # -- copies and reporting ------------------------------------------------------------------
    def __deepcopy__(self, memo):
        """An all-DRAM EmbeddingVariable with every row (what serving export freezes)."""
        with self._lock:
            return _with_storage(self, StorageOption(), self._state(), copy.deepcopy(self.optimizer, memo))

    def __getstate__(self):
        raise TypeError(f"a tiered EmbeddingVariable ({self.name!r}) cannot be pickled (its rows are on disk): "
                        "save its state_dict (a checkpoint)")

    def tier_stats(self) -> dict:
        looked = self.stats["hits"] + self.stats["disk_reads"]
        return {**self.stats, "dram_rows": self.size, "dram_capacity_rows": self.capacity,
                "dram_bytes": self.capacity * self._row_bytes(), "disk_rows": self.disk.rows,
                "disk_bytes": self.disk.nbytes(), "hit_rate": self.stats["hits"] / looked if looked else 1.0}

    def bytes_per_row(self) -> float:
        return float(self._row_bytes())

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", dram_rows={self.size}/{self.capacity}, disk_rows={self.disk.rows}, "
                f"cache={self.option.storage.cache!r}")


def _with_storage(ev: EmbeddingVariable, storage: StorageOption, state: dict, optimizer,
                  name: str | None = None) -> EmbeddingVariable:
    """A new EmbeddingVariable like `ev` (options, shard, slots, mode, step) with this storage,
    holding `state`'s rows."""
    out = embedding_variable(ev.embedding_dim, key_dtype=ev.key_dtype, ev_option=dataclasses.replace(
        ev.option, storage=storage), name=name or ev.name, shard_index=ev.shard_index, num_shards=ev.num_shards)
    out.attach_slots(dict(ev._slot_init))
    out.optimizer, out.training = optimizer, ev.training
    out.load({**state, "global_step": torch.tensor(ev.global_step)})
    return out


def sum_tier_stats(variables: list[TieredEmbeddingVariable]) -> dict:
    """The variables' tier stats summed, with the hit rate of the sums."""
    total: dict = {}
    for ev in variables:
        for k, v in ev.tier_stats().items():
            if k != "hit_rate":
                total[k] = total.get(k, 0) + v
    looked = total.get("hits", 0) + total.get("disk_reads", 0)
    total["hit_rate"] = total["hits"] / looked if looked else 1.0
    total["variables"] = len(variables)
    return total


def tier_summary(model: torch.nn.Module) -> dict | None:
    """The tiered EmbeddingVariables' stats, summed (None if the model has none)."""
    tiered = [m for m in model.modules() if isinstance(m, TieredEmbeddingVariable)]
    return sum_tier_stats(tiered) if tiered else None


def describe_tiers(total: dict) -> str:
    """One line for explain() and the run summary."""
    mb = 1 << 20
    return (f"tiered storage ({total['variables']} EmbeddingVariables): DRAM {total['dram_rows']:,} rows "
            f"({total['dram_bytes'] / mb:,.1f} MB budget), disk {total['disk_rows']:,} rows "
            f"({total['disk_bytes'] / mb:,.1f} MB); hit rate {total['hit_rate']:.1%}; read "
            f"{total['bytes_read'] / mb:,.1f} MB ({total['disk_reads']:,} rows at lookup, {total['prefetched']:,} "
            f"prefetched), written {total['bytes_written'] / mb:,.1f} MB")


def use_storage(model: torch.nn.Module, storage: StorageOption | dict[str, StorageOption]) -> int:
    """Give the EmbeddingVariables of `model` this storage (in place, rows and slots kept), or each
    the storage its name maps to (DeepRec sizes tiers per variable); returns how many. The model
    is written plainly; the trainer applies its --storage this way."""
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, EmbeddingVariable) and not isinstance(m, TieredEmbeddingVariable)
             and (isinstance(storage, StorageOption) or m.name in storage)]
    for name, ev in found:
        with ev._lock:
            tiered = _with_storage(ev, storage if isinstance(storage, StorageOption) else storage[ev.name],
                                   ev._rows_state(torch.arange(ev.size)), ev.optimizer, name=ev.name or name)
        replace_module(model, ev, tiered)  # under every name it has (one variable shared by two features)
    return len(found)


def embedding_variable(embedding_dim: int, *, ev_option: EmbeddingVariableOption | None = None,
                       **kwargs) -> EmbeddingVariable:
    """An EmbeddingVariable with the storage `ev_option` asks for: a `TieredEmbeddingVariable`
    when it has an ssd tier, else a plain one (rows in DRAM). Takes EmbeddingVariable's arguments."""
    if ev_option is not None and ev_option.storage.tiered:
        return TieredEmbeddingVariable(embedding_dim, ev_option=ev_option, **kwargs)
    return EmbeddingVariable(embedding_dim, ev_option=ev_option, **kwargs)
