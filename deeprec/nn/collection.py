"""`EmbeddingCollection`: the embeddings of many features in one fused lookup.

    forward({feature: ids}) = FusedLookup(prepare_bags(ids))   -> pooled [B, F, D]
                                                                 (+ {sequence feature: [B, L, D]})

`prepare_bags` is a pure op (SmartStage runs it ahead with the rest of the
data side); `FusedLookup` is one graph node holding the tables. Fixed-size
tables are rows of one flat tensor (one gather for all features);
EmbeddingVariables map keys to rows first. A feature may share another's table
(`table=`: a behaviour sequence embedded with its item column); keys are then
deduplicated per table, so a row is read once and updated once. A sequence
feature (`pooled=False`) keeps one vector per position instead of pooling.
The backward of the gather applies the attached row-sparse optimizer to the
unique rows only (fused), or, with `fused=False`, keeps the gradients until
`apply_pending()` (micro-batching). On parameter servers the lookup is swapped for
`deeprec.distributed.ps.worker.RemoteLookup`, which has the same inputs and outputs.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn

from deeprec.errors import ConfigError, check_choice
from deeprec.nn.lookup import (COMBINERS, EmbeddingLookup, RowGather, assemble, merge_rows, merge_shared_tables,
                                prepare_bags)
from deeprec.nn.options import EmbeddingVariableOption
from deeprec.nn.tiered import embedding_variable
from deeprec.nn.variable import Gathered, apply_variables, lookup_variables
from deeprec.ragged import Ragged

_NO_ROWS = torch.empty(0, dtype=torch.int64)


@dataclass
class EmbeddingFeature:
    """One feature of a collection. `num_embeddings=None` makes it an EmbeddingVariable.

    table: look up the table of that (earlier declared) feature instead of owning one.
    pooled: False for a sequence: ids [B, L] (negative = padding) -> [B, L, D].
    """

    name: str
    num_embeddings: int | None = None
    combiner: str = "sum"
    fill_id: int | None = None  # an empty bag looks up this id; None: the bag pools to zeros
    ev_option: EmbeddingVariableOption | None = None
    table: str | None = None
    pooled: bool = True

    def __post_init__(self):
        check_choice(f"EmbeddingFeature({self.name!r}).combiner", self.combiner, COMBINERS)
        if not self.pooled and self.fill_id is not None:
            raise ConfigError(f"EmbeddingFeature({self.name!r}): a sequence feature (pooled=False) keeps its "
                              "padding empty; fill_id applies to pooled features")


class FusedLookup(EmbeddingLookup):
    """The stateful half of the lookup: tables, optimizer state, gradient sink.

    `tables`: the features that own a table, in table order; `num_pooled`: how many of
    the looked-up features (pooled ones first) pool their bags."""

    def __init__(self, tables: list[EmbeddingFeature], dim: int, max_norm: float | None, init_bound: float,
                 num_pooled: int | None = None):
        super().__init__()
        self.features, self.dim, self.max_norm = tables, dim, max_norm
        self.num_pooled = len(tables) if num_pooled is None else num_pooled
        self.dynamic = [f.num_embeddings is None for f in tables]
        if any(self.dynamic) and not all(self.dynamic):
            raise ConfigError("an EmbeddingCollection holds either fixed-size tables or EmbeddingVariables, "
                              "not both: make two collections")
        self.optimizer = None  # a deeprec.optim.RowSparseOptimizer, once attached
        self.fused = True
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor, int | None]] = []  # part, rows, grads, gen
        self._token = torch.zeros(0, requires_grad=True)  # makes autograd call RowGather.backward
        if all(self.dynamic):
            self.variables = nn.ModuleList(embedding_variable(dim, ev_option=f.ev_option, name=f.name)
                                           for f in tables)
        else:
            sizes = [f.num_embeddings for f in tables]
            self.register_buffer("table_offsets", torch.tensor([0] + sizes[:-1]).cumsum(0), persistent=False)
            self.register_buffer("table_sizes", torch.tensor(sizes), persistent=False)
            self.weight = nn.Parameter(torch.empty(sum(sizes), dim).uniform_(-init_bound, init_bound),
                                       requires_grad=False)  # updated by the row-sparse optimizer only
            self.register_buffer("optimizer_step", torch.zeros((), dtype=torch.int64))

    # -- optimizer ------------------------------------------------------------------------
    def set_optimizer(self, optimizer, fused: bool = True) -> None:
        self.optimizer, self.fused = optimizer, fused
        specs = optimizer.slot_specs()
        if all(self.dynamic):
            for ev in self.variables:
                ev.attach_slots(specs)
        else:
            for name, (value, per_element) in specs.items():
                shape = self.weight.shape if per_element else self.weight.shape[:1]
                self.register_buffer(f"slot_{name}", torch.full(shape, value))

    def _slots(self) -> dict:
        return {name[5:]: buf for name, buf in self.named_buffers(recurse=False) if name.startswith("slot_")}

    def _receive(self, part: int, rows: torch.Tensor, grad: torch.Tensor, begin: bool = True,
                 generation: int | None = None) -> None:
        """`begin`: this gradient is the step's first (a collection of EmbeddingVariables hands
        one per table to the same backward; the optimizer step begins once). `generation`:
        an EmbeddingVariable's row numbering the rows belong to (rows may move on a save)."""
        if self.optimizer is None:
            if all(self.dynamic):
                raise RuntimeError("an EmbeddingCollection of EmbeddingVariables needs a row-sparse optimizer: "
                                   "collection.set_optimizer(dr.optim.Adagrad(...)) or deeprec.optim.make_optimizer")
            # no row-sparse optimizer: leave a sparse gradient for torch.optim, like nn.Embedding(sparse=True)
            sparse = torch.sparse_coo_tensor(rows.unsqueeze(0), grad, self.weight.shape)
            self.weight.grad = sparse if self.weight.grad is None else self.weight.grad + sparse
            return
        if self.fused:
            if begin:
                self.optimizer.begin_step()
            self._apply_rows(part, rows, grad, generation=generation)
        else:
            self._pending.append((part, rows, grad, generation))

    def _receive_variables(self, _, grad: torch.Tensor, found: list) -> None:
        """The gradient of every EmbeddingVariable's rows of one lookup, split per variable (the
        first begins the optimizer step): one fused apply where it can."""
        if self.fused and self.optimizer is not None and apply_variables(self.optimizer, list(self.variables),
                                                                          found, grad):
            return
        for part, ((rows, generation), part_grad) in enumerate(zip(found, grad.split([r.numel() for r, _ in found]))):
            self._receive(part, rows, part_grad, begin=part == 0, generation=generation)

    def _apply_rows(self, part: int, rows: torch.Tensor, grad: torch.Tensor, unique: bool = True,
                    generation: int | None = None) -> None:
        """`unique`: the rows of one lookup are distinct already (per-table unique
        keys in disjoint row ranges); gradients gathered over several backwards are not."""
        if not unique:
            rows, grad = merge_rows(rows, grad)
        if all(self.dynamic):
            ev = self.variables[part]
            ev.global_step = self.optimizer.step_count
            ev.apply_update(self.optimizer, rows, grad, generation)
        else:
            self.optimizer.update(self.weight.data, self._slots(), rows, grad)
            self.optimizer_step.fill_(self.optimizer.step_count)

    # -- EmbeddingLookup: deferred updates, prefetch, placement ---------------------------------
    @property
    def updates_in_backward(self) -> bool:
        return self.optimizer is not None and self.fused

    def defer_updates(self, defer: bool) -> None:
        self.fused = not defer

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def can_prefetch(self) -> bool:
        """Tiered EmbeddingVariables whose StorageOption asks to promote the next batch's rows."""
        return any(ev.can_prefetch for ev in self.variables) if all(self.dynamic) else False

    def prefetch(self, keys, train: bool) -> None:
        """Promote the rows of the staged unique keys (one tensor per table) into DRAM."""
        for ev, table_keys in zip(self.variables, keys):
            if ev.can_prefetch:
                ev.prefetch(table_keys, train)

    @property
    def hash_tables(self) -> bool:
        return all(self.dynamic)

    def apply_pending(self) -> None:
        """Apply the gradients kept since the last step (fused=False): rows seen in
        several backwards are merged, then one optimizer step."""
        if not self._pending:
            return
        self.optimizer.begin_step()
        for part in sorted({p for p, *_ in self._pending}):
            mine = [(r, g, gen) for p, r, g, gen in self._pending if p == part]
            lock = self.variables[part]._lock if all(self.dynamic) else contextlib.nullcontext()
            with lock:  # rows of several lookups, renumbered to the EV's current generation, then merged
                current = None if not all(self.dynamic) else self.variables[part].generation
                rows = torch.cat([r if gen is None else self.variables[part].current_rows(r, gen)
                                  for r, _, gen in mine])
                grads = torch.cat([g for _, g, _ in mine])
                self._apply_rows(part, rows, grads, unique=False, generation=current)
        self._pending.clear()

    def discard_pending(self) -> None:
        self._pending.clear()

    # -- lookup ------------------------------------------------------------------------------
    def forward(self, uniques, inverse, offsets, weights, counts, masks=()):
        """Unique keys per table -> pooled [B, P, D] (and the sequence features' [B, L, D])."""
        if self._pending and self.fused and self.training:
            self.check_applied()
        home = self.table_device
        if uniques and uniques[0].device != home:  # tables on the host, the step on a GPU (deeprec.runtime.device)
            uniques, counts = [u.to(home) for u in uniques], [c.to(home) for c in counts]
        if all(self.dynamic):
            # one native call: keys found or inserted, freq counting every occurrence, rows gathered
            rows_values, found = lookup_variables(list(self.variables), uniques, counts, self.training)
            if self.training and torch.is_grad_enabled():  # one autograd node for every variable
                rows_values = RowGather.apply(self._token, Gathered(rows_values), _NO_ROWS,
                                              functools.partial(self._receive_variables, found=found))
        else:
            keys = torch.cat(uniques)
            counts = torch.tensor([k.numel() for k in uniques], device=keys.device)
            limits = torch.repeat_interleave(self.table_sizes, counts)
            # one vectorized range check for all tables (an exported program has no data-dependent raise)
            if not torch.compiler.is_exporting() and bool((keys >= limits).any()):
                f = int(torch.repeat_interleave(torch.arange(len(uniques), device=keys.device), counts)[keys >= limits][0])
                raise IndexError(f"feature {self.features[f].name!r}: id {int(uniques[f].max())} is out of "
                                 f"range [0, {self.features[f].num_embeddings})")
            rows = keys + torch.repeat_interleave(self.table_offsets, counts)
            if self.training and torch.is_grad_enabled():
                rows_values = RowGather.apply(self._token, self.weight.data, rows,
                                              lambda r, g: self._receive(0, r, g))
            else:  # no gradient to route: a plain gather (what an exported program holds)
                rows_values = self.weight.index_select(0, rows)
        rows_values = rows_values.to(inverse.device)  # differentiable: gradients return to the tables' device
        return assemble(rows_values, inverse, offsets, weights, masks, self.num_pooled, self.max_norm)

    def table_nbytes(self) -> int:
        """The fixed tables' values and optimizer slots (EmbeddingVariables grow: not counted)."""
        if all(self.dynamic):
            return 0
        return sum(t.numel() * t.element_size() for t in [self.weight, *self._slots().values()])

    @property
    def table_device(self) -> torch.device:
        """Where the rows live: EmbeddingVariables on the host, fixed tables where `.to()` put them."""
        return torch.device("cpu") if all(self.dynamic) else self.weight.device

    def get_extra_state(self):
        return {"optimizer": self.optimizer.state_dict() if self.optimizer else None}

    def set_extra_state(self, state):
        if state and state.get("optimizer") and self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])


class EmbeddingCollection(nn.Module):
    """Embeddings of many features, looked up together: ids in, [B, F, D] out.

    ids per feature: a [B] tensor (one id per row), [B, L] (multi-hot; negative
    = no id) or `Ragged(values, offsets)`. Or a TorchRec KeyedJaggedTensor (pooled
    features only): the result is then a KeyedTensor [B, F*D], as torchrec's
    EmbeddingBagCollection returns (deeprec.interop.torchrec). Invalid (negative) ids are pruned,
    empty bags filled (`fill_id`) or zero, ids deduplicated, rows gathered once,
    and bags pooled with each feature's combiner (sum | mean | sqrtn).

    With sequence features (`pooled=False`, ids [B, L], negative = padding) the
    result is `(pooled [B, F, D], {sequence name: [B, L, D]})`, padding zero.
    """

    def __init__(self, features: list[EmbeddingFeature], embedding_dim: int, *, max_norm: float | None = None,
                 init_bound: float = 0.05):
        super().__init__()
        names = [f.name for f in features]
        if len(set(names)) != len(names):
            raise ConfigError(f"feature names must be unique, got {names}")
        owners = [f for f in features if f.table is None]
        owner_index = {f.name: t for t, f in enumerate(owners)}
        for f in features:
            if f.table is not None and f.table not in owner_index:
                raise ConfigError(f"EmbeddingFeature({f.name!r}).table={f.table!r} must name a feature of the "
                                  f"collection that owns its table ({', '.join(owner_index)})")
        ordered = [f for f in features if f.pooled] + [f for f in features if not f.pooled]
        self.names = [f.name for f in ordered if f.pooled]  # the pooled output's feature order
        self.sequence_names = [f.name for f in ordered if not f.pooled]
        self._order = [f.name for f in ordered]
        self.combiners = tuple(f.combiner for f in ordered)
        self.fill_ids = tuple(f.fill_id for f in ordered)
        table_of = tuple(owner_index[f.table if f.table is not None else f.name] for f in ordered)
        self.table_of = None if table_of == tuple(range(len(ordered))) else table_of  # else keys merge per table
        self.lookup = FusedLookup(owners, embedding_dim, max_norm, init_bound, num_pooled=len(self.names))
        self.embedding_dim = embedding_dim
        self.kjt_known = None  # the KeyedJaggedTensor keys taken (None: the features'; others are an error)

    def set_optimizer(self, optimizer, fused: bool = True) -> "EmbeddingCollection":
        self.lookup.set_optimizer(optimizer, fused)
        return self

    def apply_pending(self) -> None:
        """Apply the row gradients kept over micro-batches (set_optimizer(..., fused=False))."""
        self.lookup.apply_pending()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.lookup.discard_pending()

    def forward(self, ids):
        # TorchRec's KeyedJaggedTensor, known without importing torchrec; traced, it is a Proxy (torchrec's
        # classes are proxyable), which no other input is: the keys are checked when it runs
        keyed = type(ids).__name__ == "KeyedJaggedTensor" or isinstance(ids, torch.fx.Proxy)
        if keyed:
            from deeprec.nn.keyed import kjt_columns
            if self.sequence_names:
                raise ConfigError(f"sequence features ({', '.join(self.sequence_names)}) take padded ids [B, L], "
                                  "not a KeyedJaggedTensor: a KJT input embeds pooled features only")
            ordered = kjt_columns(ids, self._order, self.kjt_known)
        else:
            ordered = [ids[name] for name in self._order] if isinstance(ids, dict) else list(ids)
        uniques, inverse, offsets, weights, counts = prepare_bags(ordered, self.combiners, self.fill_ids)
        if self.table_of is not None:  # shared tables: one key set per table
            uniques, inverse, counts = merge_shared_tables(uniques, inverse, counts, self.table_of)
        if not self.sequence_names:
            pooled = self.lookup(uniques, inverse, offsets, weights, counts)
            if keyed:  # what torchrec's EmbeddingBagCollection returns: KeyedTensor [B, F*D], a view
                from deeprec.nn.keyed import to_keyed_tensor
                return to_keyed_tensor(pooled, self.names, self.embedding_dim)
            return pooled
        sequences = ordered[len(self.names):]
        for name, seq in zip(self.sequence_names, sequences):
            if isinstance(seq, tuple):
                raise ConfigError(f"sequence feature {name!r} takes padded ids [B, L] (negative = padding), "
                                  "not a Ragged: deeprec.ops.pad_ragged(ragged, max_length, -1)")
        masks = tuple(seq >= 0 for seq in sequences)
        pooled, sequences = self.lookup(uniques, inverse, offsets, weights, counts, masks)
        return pooled, {name: sequences[s] for s, name in enumerate(self.sequence_names)}  # indexed: fx-traceable


__all__ = ["EmbeddingCollection", "EmbeddingFeature", "FusedLookup", "Ragged"]
