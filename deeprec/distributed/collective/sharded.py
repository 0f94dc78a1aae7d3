"""Collective training's embedding half: table rows sharded over the ranks, by all-to-all.

    rank r, one step (world N; EmbeddingVariable rows of key k live on rank k % 1000 % N, fixed
    tables' rows row-wise or table-wise per deeprec.distributed.collective.planner's plan):

    forward   unique keys of each table ──all_to_all(counts, ids)──> the owners look up their rows
              (one lookup per table, keys from every rank merged) ──all_to_all(values)──> rows [U, D]
    backward  rows' gradient ──all_to_all(grads)──> the owners sum every rank's gradient of a row,
              divide by N (the global batch's mean) and apply the row-sparse optimizer locally:
              at once (fused), or at the optimizer's step (CollectiveUpdater: after a finite check)

`shard_embeddings(model)` (collective/updater.py) swaps each EmbeddingCollection's lookup for a
ShardedLookup (as the PS worker swaps in a RemoteLookup), same inputs and outputs. The dense layers are data parallel (DDP,
or CollectiveUpdater's bucketed all-reduce). The exchange runs on its own process group, so its
collectives never interleave with the dense all-reduces on the default group.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from deeprec.distributed.allreduce import Traffic
from deeprec.distributed.collective import deadline
from deeprec.distributed.collective.deadline import guard
from deeprec.errors import ConfigError
from deeprec.nn.collection import FusedLookup
from deeprec.nn.lookup import EmbeddingLookup, assemble
from deeprec.nn.variable import shard_of
from deeprec.nn.lookup import merge_rows
from deeprec.distributed.collective.planner import FixedShard, describe_plan, plan_lookup


def _exchange(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], lookup) -> torch.Tensor:
    """all_to_all_single along dim 0 with these split sizes, counted in lookup.traffic."""
    out = send.new_empty((sum(recv_counts), *send.shape[1:]))
    row_bytes = send[:1].numel() * send.element_size()
    started = time.perf_counter()
    with guard("the all-to-all of the embedding exchange"):
        dist.all_to_all_single(out, send.contiguous(), recv_counts, send_counts, group=lookup.group)
    lookup.traffic.add(time.perf_counter() - started,
                       row_bytes * (sum(send_counts) - send_counts[lookup.rank]))  # own rows never leave
    return out


def _return_rows(values: torch.Tensor, lookup, plan: dict) -> torch.Tensor:
    got = _exchange(values, plan["recv_counts"], plan["send_counts"], lookup)
    out = torch.empty_like(got)
    out[plan["order"]] = got  # back to this rank's key order
    return out


class _ReturnRows(torch.autograd.Function):
    """Owners' values back to the ranks that asked; the backward sends the gradients to the owners."""

    @staticmethod
    def forward(ctx, token, values, lookup, plan):
        ctx.lookup, ctx.plan = lookup, plan
        return _return_rows(values, lookup, plan)

    @staticmethod
    def backward(ctx, grad):
        plan, lookup = ctx.plan, ctx.lookup
        grads = _exchange(grad[plan["order"]], plan["send_counts"], plan["recv_counts"], lookup)
        lookup.apply(plan, grads)
        return None, None, None, None


class ShardedLookup(EmbeddingLookup):
    """Stands in for a FusedLookup: this rank's shard of every table (EmbeddingVariables or fixed)."""

    must_run_backward = True  # every rank's forward and backward pair up: a backward is never skipped

    # EmbeddingLookup: rows updated in backward, or kept over micro-batches for apply_pending
    @property
    def updates_in_backward(self) -> bool:
        return self.fused

    def defer_updates(self, defer: bool) -> None:
        self.fused = not defer

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def hash_tables(self) -> bool:
        return all(self.dynamic)

    def __init__(self, fused: FusedLookup, group=None):
        super().__init__()
        if fused.optimizer is None:
            raise ConfigError("a sharded EmbeddingCollection needs its row-sparse optimizer: "
                              "deeprec.optim.make_optimizer(model) before shard_embeddings")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._group = group  # made at the first exchange, for the tables' device (deeprec.runtime.device)
        self.num_pooled, self.max_norm, self.dim = fused.num_pooled, fused.max_norm, fused.dim
        self.optimizer = fused.optimizer
        self.table_sizes = [f.num_embeddings for f in fused.features]  # None: an EmbeddingVariable
        self.plans = plan_lookup(fused, self.world)
        if all(fused.dynamic):
            self.variables = fused.variables
            for ev in self.variables:  # this rank keeps (and checkpoints) the keys it owns
                ev.shard_index, ev.num_shards = self.rank, self.world
        else:  # fixed tables: this rank's rows of each, per the plan
            slots = fused._slots()
            bounds = torch.tensor([0] + self.table_sizes).cumsum(0).tolist()
            self.variables = nn.ModuleList(
                FixedShard(fused.weight.data[a:b], {n: s[a:b] for n, s in slots.items()}, plan, self.rank, self.world)
                for a, b, plan in zip(bounds[:-1], bounds[1:], self.plans))
        self._token = torch.zeros(0, requires_grad=True)
        self.traffic = Traffic()  # the all-to-alls of ids, rows and gradients
        self.fused, self._pending = True, []  # micro-batching keeps the updates for apply_pending()

    def forward(self, uniques, inverse, offsets, weights, counts, masks=()):
        rows_values = self.rows(uniques, counts).to(inverse.device)  # differentiable: gradients return home
        return assemble(rows_values, inverse, offsets, weights, masks, self.num_pooled, self.max_norm)

    def rows(self, uniques, counts) -> torch.Tensor:
        """The rows of this rank's unique keys of every table, in order ([sum of U, D], on the tables'
        device), from their owners; differentiable: the backward sends the gradients to the owners."""
        if self._pending and self.fused and self.training:
            self.check_applied()
        home = self.table_device
        uniques, counts = [u.to(home) for u in uniques], [c.to(home) for c in counts]  # no-ops on one device
        sizes = [k.numel() for k in uniques]
        keys, seen = torch.cat(uniques).long(), torch.cat(counts).long()
        table = torch.repeat_interleave(torch.arange(len(uniques), device=home), torch.tensor(sizes, device=home))
        owner = self._owners(uniques, keys)
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=self.world)
        recv_counts = _exchange(send_counts, [1] * self.world, [1] * self.world, self)
        send_counts, recv_counts = send_counts.tolist(), recv_counts.tolist()
        asked = _exchange(torch.stack([keys, table, seen], 1)[order], send_counts, recv_counts, self)
        plan = {"order": order, "send_counts": send_counts, "recv_counts": recv_counts, "tables": []}
        values = torch.empty(asked.shape[0], self.dim, device=home)
        for t, ev in enumerate(self.variables):  # every rank's keys of a table: merged, one lookup
            sel = torch.nonzero(asked[:, 1] == t).squeeze(1)
            mine, where = torch.unique(asked[sel, 0], return_inverse=True)
            merged = torch.zeros(mine.numel(), dtype=torch.long, device=home).index_add_(0, where, asked[sel, 2])
            rows, found, generation = ev.lookup(mine, merged, train=self.training)
            values[sel] = found[where]
            plan["tables"].append((sel, where, mine.numel(), rows, generation))
        if self.training and torch.is_grad_enabled():
            return _ReturnRows.apply(self._token, values, self, plan)
        return _return_rows(values, self, plan)

    @property
    def dynamic(self) -> list[bool]:
        return [size is None for size in self.table_sizes]

    def table_nbytes(self) -> int:
        """This rank's fixed-table rows and slots (EmbeddingVariables grow: not counted)."""
        return 0 if all(self.dynamic) else sum(shard.nbytes() for shard in self.variables)

    @property
    def table_device(self) -> torch.device:
        return torch.device("cpu") if all(self.dynamic) else self.variables[0].weight.device

    @property
    def group(self):
        """The exchange's own process group: NCCL for tables on a GPU, gloo for tables on the host
        (also beside an NCCL default group: the dense all-reduce on the GPU)."""
        if self._group is None:
            self._group = dist.new_group(backend="nccl" if self.table_device.type == "cuda" else "gloo",
                                         timeout=deadline.timeout())  # None: torch's default (30 min)
        return self._group

    def _owners(self, uniques: list[torch.Tensor], keys: torch.Tensor) -> torch.Tensor:
        if all(self.dynamic):
            return shard_of(keys, self.world)
        for f, (ids, size) in enumerate(zip(uniques, self.table_sizes)):  # asked here: the owner could not say
            if ids.numel() and int(ids.max()) >= size:
                raise IndexError(f"feature {self.plans[f].name!r}: id {int(ids.max())} is out of range [0, {size})")
        return torch.cat([shard.owner_of(ids.long()) for shard, ids in zip(self.variables, uniques)])

    def explain(self) -> list[str]:
        return describe_plan(self.plans, self.world)

    def get_extra_state(self):  # the row-sparse optimizer's step count (Adam's bias correction, row versions)
        return {"optimizer": self.optimizer.state_dict() if self.optimizer else None}

    def set_extra_state(self, state):
        if state and state.get("optimizer") and self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    def apply(self, plan: dict, grads: torch.Tensor) -> None:
        """Every rank's gradient of this rank's rows: summed per row, / world (the global batch's
        mean); one optimizer step, or kept for `apply_pending()` over micro-batches (fused False)."""
        updates = [(rows, torch.zeros(n, self.dim, device=grads.device).index_add_(0, where, grads[sel]) / self.world,
                    generation)
                   for sel, where, n, rows, generation in plan["tables"]]
        if self.fused:
            self._update(updates)
        else:
            self._pending.append(updates)

    def _update(self, updates: list) -> None:
        self.optimizer.begin_step()
        for ev, (rows, grad, generation) in zip(self.variables, updates):
            ev.global_step = self.optimizer.step_count
            ev.apply_update(self.optimizer, rows, grad, generation)

    # the OptimizerGroup's side of micro-batching, as FusedLookup's
    def apply_pending(self) -> None:
        """The gradients kept over a step's micro-batches: rows merged per table, one optimizer step."""
        if not self._pending:
            return
        merged = []
        for t, ev in enumerate(self.variables):
            with ev._lock:  # rows renumbered to the EV's current generation, then merged
                rows = torch.cat([ev.current_rows(kept[t][0], kept[t][2]) for kept in self._pending])
                rows, grad = merge_rows(rows, torch.cat([kept[t][1] for kept in self._pending]))
                merged.append((rows, grad, ev.generation))
        self._pending.clear()
        self._update(merged)

    def discard_pending(self) -> None:
        self._pending.clear()

    def check_applied(self) -> None:
        if self._pending:
            raise RuntimeError("embedding gradients kept over the last step's micro-batches were never applied: "
                               "step the optimizer of deeprec.optim.make_optimizer after each micro-batched step")


def evaluate_sharded(model: nn.Module, reader, **columns) -> dict:
    """deeprec.metrics' evaluation loop on every rank at once, each over its share of the evaluation
    data.

    The ranks step together (each forward exchanges ids with the others): a rank whose share has
    ended runs its last batch again, uncounted, until every share has ended. The metrics'
    histograms and sums are then added up over the ranks, so every rank returns the whole."""
    from deeprec.metrics import run_evaluation

    evaluation = run_evaluation(model, _lockstep(reader), progress=False, **columns)
    with guard("the all-reduce of the evaluation metrics"):
        evaluation.all_reduce(device=_default_group_device())
    return evaluation.result()


def _default_group_device() -> torch.device:
    """Where tensors for the default group's collectives live: the GPU under NCCL."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _lockstep(reader):
    """This rank's batches, then its last one again, uncounted (deeprec.metrics.Uncounted), while
    another rank still has batches."""
    from deeprec.metrics import Uncounted

    batches = iter(reader)
    started, last = False, None
    while True:
        batch = next(batches, None)
        state = torch.tensor([batch is not None, batch is None and not started], dtype=torch.int64,
                             device=_default_group_device())
        with guard("evaluation's lockstep all-reduce"):
            dist.all_reduce(state)
        if int(state[1]):  # every rank learns it, so none waits in a lookup for it
            raise ConfigError(f"{int(state[1])} rank(s) got no evaluation rows: their share of the evaluation data "
                              "is empty; give more evaluation data (files are split into byte ranges) or fewer ranks")
        if not int(state[0]):
            return
        started = True
        if batch is None:
            yield Uncounted(last)  # answers the other ranks' lookups
        else:
            yield batch
            last = batch


__all__ = ["ShardedLookup", "evaluate_sharded"]
