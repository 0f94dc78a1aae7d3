"""Where collective training keeps each table's rows: the plan, and a rank's shard of a fixed table.

    EmbeddingVariable      row-wise by key % 1000 % N (DeepRec's partitioning; grows on any rank)
    fixed table, large     row-wise: row r on rank r % N, at local row r // N (memory and lookups spread)
    fixed table, small     table-wise: every row on one rank (the least loaded, largest tables first)

"Large": whole on one rank it would take more than `ROW_WISE_SHARE` of a rank's fair share of the
fixed tables' bytes (values + optimizer slots). `plan_tables` is a pure function of the tables,
so `deeprec explain --ranks N` prints the plan, with sizes and the memory per rank, before a job
starts; a rank's ShardedLookup keeps its plan for `explain()`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn

ROW_WISE_SHARE = 0.5


@dataclass(frozen=True)
class TablePlan:
    name: str
    rows: int | None  # None: an EmbeddingVariable (grows)
    dim: int
    bytes: int  # values + slots of the fixed table (0 for an EmbeddingVariable: it grows)
    placement: str  # "row-wise" | "table-wise"
    owner: int | None  # table-wise: the rank holding it

    def describe(self) -> str:
        size = "grows" if self.rows is None else f"{self.rows:,} rows, {self.bytes / 2**20:,.1f} MiB"
        where = (f"on rank {self.owner}" if self.placement == "table-wise" else
                 "key % 1000 % N" if self.rows is None else "row % N")
        return f"{self.name}: {size}, {self.placement} ({where})"


def plan_tables(tables: list[tuple[str, int | None, int]], world: int, slot_floats_per_row: int = 0) -> list[TablePlan]:
    """tables: (name, rows or None for an EmbeddingVariable, dim). Row-wise for EmbeddingVariables and
    fixed tables too big for one rank's share; the others table-wise, packed largest first onto the
    rank with the fewest bytes."""
    sizes = {name: rows * (dim + slot_floats_per_row) * 4 if rows is not None else 0 for name, rows, dim in tables}
    fair = sum(sizes.values()) / world
    load = [0] * world
    placed = {}
    for name, rows, dim in sorted(tables, key=lambda t: -sizes[t[0]]):
        if rows is None or world == 1 or sizes[name] > ROW_WISE_SHARE * fair:
            placed[name] = TablePlan(name, rows, dim, sizes[name], "row-wise", None)
            for r in range(world):
                load[r] += sizes[name] / world
        else:
            owner = min(range(world), key=lambda r: (load[r], r))
            load[owner] += sizes[name]
            placed[name] = TablePlan(name, rows, dim, sizes[name], "table-wise", owner)
    return [placed[name] for name, _, _ in tables]


def describe_plan(plans: list[TablePlan], world: int) -> list[str]:
    """explain()'s lines: each table's placement, then the fixed tables' bytes per rank."""
    per_rank = [0.0] * world
    for p in plans:
        if p.placement == "table-wise":
            per_rank[p.owner] += p.bytes
        else:
            per_rank = [b + p.bytes / world for b in per_rank]
    lines = [f"collective sharding over {world} ranks (deeprec.distributed.collective.planner):"]
    lines += [f"  {p.describe()}" for p in plans]
    if any(p.rows is not None for p in plans):
        lines.append("  fixed tables per rank: " + ", ".join(f"rank {r} {b / 2**20:,.1f} MiB" for r, b in enumerate(per_rank)))
    return lines


def plan_lookup(lookup: nn.Module, world: int) -> list[TablePlan]:
    """The plan of a FusedLookup's tables over `world` ranks; its row-sparse optimizer's slots count
    in the bytes (none attached: the values only)."""
    specs = lookup.optimizer.slot_specs() if lookup.optimizer is not None else {}
    return plan_tables([(f.name, f.num_embeddings, lookup.dim) for f in lookup.features], world,
                       sum(lookup.dim if per_element else 1 for _, per_element in specs.values()))


def free_variables(model: nn.Module) -> list:
    """`model`'s free EmbeddingVariables (not an EmbeddingCollection's tables), each once."""
    from deeprec.nn.collection import EmbeddingCollection
    from deeprec.nn.variable import EmbeddingVariable

    tables = {id(ev) for c in model.modules() if isinstance(c, EmbeddingCollection) for ev in c.modules()}
    return [m for m in model.modules() if isinstance(m, EmbeddingVariable) and id(m) not in tables]


def plan_model(model: nn.Module, world: int) -> list[str]:
    """explain()'s lines for `model`'s EmbeddingCollections and free EmbeddingVariables sharded over
    `world` ranks."""
    from deeprec.nn.collection import EmbeddingCollection
    from deeprec.nn.shared import module_paths

    lines = []
    for collection in (m for m in model.modules() if isinstance(m, EmbeddingCollection)):
        lines += describe_plan(plan_lookup(collection.lookup, world), world)
    free, paths = free_variables(model), module_paths(model)
    if free:
        lines.append(f"free EmbeddingVariables over {world} ranks (all-to-all of their rows each step):")
        lines += [f"  {' = '.join(paths[id(ev)])}: grows, {ev.embedding_dim} dims, row-wise (key % 1000 % N)"
                  for ev in free]
    return lines


class FixedShard(nn.Module):
    """A rank's rows of one fixed-size table, behind the interface of an EmbeddingVariable that
    ShardedLookup uses (lookup, apply_update, owner_of); its state is an EmbeddingVariable's
    layout (global row ids as `keys`), so checkpoints reshard the same way."""

    def __init__(self, table: torch.Tensor, slots: dict[str, torch.Tensor], plan: TablePlan, rank: int, world: int):
        super().__init__()
        self.plan, self.rank, self.world, self.num_rows = plan, rank, world, table.shape[0]
        ids = self._owned_ids().to(table.device)
        # plain tensors, not buffers: DDP would broadcast rank 0's buffers over every rank's shard
        self.weight = table[ids].clone()
        self.slots = {name: s[ids].clone() for name, s in slots.items()}
        self.global_step = 0  # what ShardedLookup sets before an update (rows here have no version)
        self.generation = 0
        self._lock = threading.RLock()

    def _apply(self, fn, recurse=True):  # .to(device) moves the shard
        self.weight = fn(self.weight)
        self.slots = {name: fn(s) for name, s in self.slots.items()}
        return super()._apply(fn, recurse)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [self.weight, *self.slots.values()])

    def _owned_ids(self) -> torch.Tensor:
        if self.plan.placement == "table-wise":
            return torch.arange(self.num_rows) if self.rank == self.plan.owner else torch.zeros(0, dtype=torch.long)
        return torch.arange(self.rank, self.num_rows, self.world)  # then on the table's device

    def owner_of(self, ids: torch.Tensor) -> torch.Tensor:
        if self.plan.placement == "table-wise":
            return torch.full_like(ids, self.plan.owner)
        return torch.remainder(ids, self.world)

    def _local(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.plan.placement == "table-wise" else torch.div(ids, self.world, rounding_mode="floor")

    def lookup(self, keys: torch.Tensor, counts=None, train: bool = True):
        rows = self._local(keys)
        return rows, self.weight.index_select(0, rows), None

    def current_rows(self, rows: torch.Tensor, generation) -> torch.Tensor:
        return rows  # fixed rows never move

    def apply_update(self, optimizer, rows: torch.Tensor, grad: torch.Tensor, generation=None) -> None:
        optimizer.update(self.weight, self.slots, rows, grad)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "keys"] = self._owned_ids().to(self.weight.device)
        destination[prefix + "values"] = self.weight.clone()
        for name, slot in self.slots.items():
            destination[prefix + f"slot.{name}"] = slot.clone()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if prefix + "keys" not in state_dict:
            missing_keys.append(prefix + "keys")
            return
        keys = state_dict[prefix + "keys"].long().to(self.weight.device)
        mine = self.owner_of(keys) == self.rank  # a checkpoint of any world size: keep the rows owned now
        rows = self._local(keys[mine])
        self.weight[rows] = state_dict[prefix + "values"].to(self.weight.device)[mine]
        for name, slot in self.slots.items():
            slot[rows] = state_dict[prefix + f"slot.{name}"].to(slot.device)[mine]

    def extra_repr(self) -> str:
        return f"{self.plan.describe()}, {self.weight.shape[0]} rows here"
