"""A PS shard's embedding rows in DRAM + disk tiers (`python -m deeprec.distributed.ps --storage ssd`).

    TieredArena: EmbeddingArena's interface over one TieredEmbeddingVariable per variable
        (variable id, key) ──> the variable's DRAM row (promoted from disk when cold)
        row numbers travel as  variable id << 40 | row   within one request

A row may leave DRAM between requests, so rows are only used within the request that
found them (a pull gathers at once; a push finds its rows when it applies them, which
for sync training is when the last worker's push arrives: ShardState._apply).

A disk tier with no room (its filesystem full: StorageFullError, "no space left on PATH: N bytes
needed") or a --storage-path that cannot hold it (ConfigError) answers the request that met it
with RESOURCE_EXHAUSTED and that text; the shard keeps serving (never a SIGBUS: disk_rows
reserves the file's blocks before it maps them).
"""
from __future__ import annotations

import contextlib
import tempfile

import torch

from deeprec.distributed.ps.wire import ResourceExhausted
from deeprec.errors import ConfigError, StorageFullError
from deeprec.nn.options import EmbeddingVariableOption, StorageOption
from deeprec.nn.tiered import TieredEmbeddingVariable, sum_tier_stats
from deeprec.optim import sparse
from deeprec.nn.lookup import merge_rows
from deeprec.nn.disk_rows import check_tier_folder

_ROW_BITS = 40
_INDEX_BYTES = 48  # a key's entry in the DRAM or disk index (16-byte slots, 1/4 to 1/2 full), about


@contextlib.contextmanager
def _disk_errors(*also: type[Exception]):
    """A full disk tier (and the errors `also` names) as the request's answer: RESOURCE_EXHAUSTED with
    their one line."""
    try:
        yield
    except (StorageFullError, *also) as err:
        raise ResourceExhausted(str(err)) from None


class TieredArena:
    def __init__(self, dim: int, optimizer: sparse.RowSparseOptimizer, storage: StorageOption,
                 shard_index: int = 0, num_shards: int = 1):
        self.dim, self.optimizer, self.storage = dim, optimizer, storage
        with _disk_errors(ConfigError):  # a --storage-path that cannot hold the tier: its Register fails
            check_tier_folder(storage.path or tempfile.gettempdir())
        self.shard_index, self.num_shards = shard_index, num_shards
        self.names: list[str] = []
        self.variables: list[TieredEmbeddingVariable] = []
        self.slots = {name: torch.empty((0, dim) if per_element else (0,))  # the slots' shapes (Load checks)
                      for name, (_, per_element) in optimizer.slot_specs().items()}

    def add(self, name: str, defaults: torch.Tensor) -> int:
        with _disk_errors(ConfigError):
            ev = TieredEmbeddingVariable(self.dim, ev_option=EmbeddingVariableOption(storage=self.storage), name=name,
                                         shard_index=self.shard_index, num_shards=self.num_shards)
            ev._defaults = defaults.float().clone()  # the worker's initializer matrix
            ev.attach_slots(self.optimizer.slot_specs())
        self.names.append(name)
        self.variables.append(ev)
        return len(self.names) - 1

    def bytes_per_row(self) -> int:
        """DRAM a new key costs: its index entries (its row goes to disk when DRAM is full)."""
        return _INDEX_BYTES

    def memory(self) -> int:
        return sum(ev.capacity * ev._row_bytes() + ev._index.nbytes() + ev._disk_index.nbytes()
                   for ev in self.variables)

    def rows(self, ns: torch.Tensor, keys: torch.Tensor, insert: bool) -> tuple[torch.Tensor, int]:
        """(variable << 40 | DRAM row of each pair, -1 if not held; how many pairs repeat an earlier one)."""
        out = torch.full_like(keys, -1)
        repeated = 0
        for var in torch.unique(ns).tolist():
            sel = torch.nonzero(ns == var).squeeze(1)
            mine = keys[sel]
            distinct, inverse, counts = torch.unique(mine, return_inverse=True, return_counts=True)
            repeated += mine.numel() - distinct.numel()
            ev = self.variables[var]
            ev.global_step = self.optimizer.step_count  # the version a new row starts with
            with _disk_errors(ConfigError):  # this request's keys do not fit the DRAM tier, or the disk tier is full
                rows = ev.rows_for(distinct, counts, train=insert)[inverse]
            out[sel] = torch.where(rows >= 0, (var << _ROW_BITS) | rows, -1)
        return out, repeated

    def _split(self, rows: torch.Tensor):
        var = rows >> _ROW_BITS
        for v in torch.unique(var[rows >= 0]).tolist():
            sel = torch.nonzero((var == v) & (rows >= 0)).squeeze(1)
            yield self.variables[v], sel, rows[sel] & ((1 << _ROW_BITS) - 1)

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Each pair's values; a row -1 (a key never trained) reads zeros."""
        values = torch.zeros(rows.numel(), self.dim) if out is None else out.zero_()
        for ev, sel, local in self._split(rows):
            values[sel] = ev.weight.index_select(0, local)
        return values

    def apply(self, rows: torch.Tensor, grad: torch.Tensor, repeated: bool = True) -> None:
        """One optimizer step over every variable's rows (-1 rows dropped, duplicates summed)."""
        self.optimizer.begin_step()
        for ev, sel, local in self._split(rows):
            g = grad[sel]
            if repeated:
                local, g = merge_rows(local, g)
            ev.global_step = self.optimizer.step_count
            with _disk_errors():  # a row that went to disk since the lookup, promoted back: may evict
                ev.apply_update(self.optimizer, local, g)

    def export(self, var: int) -> dict:
        state = self.variables[var].export()
        state.pop("incremental")
        state["global_step"] = torch.tensor(self.optimizer.step_count)
        return state

    def load(self, states: dict[int, dict], shard_index: int, num_shards: int) -> None:
        for var, state in states.items():  # each variable keeps this shard's keys (its shard_of filter)
            with _disk_errors():
                self.variables[var].load({**state, "global_step": torch.tensor(self.optimizer.step_count)})

    def tier_stats(self) -> dict:
        return sum_tier_stats(self.variables)
