"""Training a model whose parameters live on the parameter servers.

    PSUpdater(model, client) swaps each EmbeddingCollection's lookup for a RemoteLookup
    (as TorchRec's sharders swap modules) and registers every variable on the PSs:

    step:  before_step: pull dense parameters (dense="ps") ──> forward (each RemoteLookup
           pulls its rows: one fused call per PS) ──> backward (embedding gradients are
           kept, not applied) ──> apply: dense="allreduce": all-reduce the dense gradients,
           step the local optimizer; one push of the (embedding) gradients; the PSs update

Embeddings must be EmbeddingVariables (`embedding="variable"`): their keys are
partitioned over the PSs by `key % 1000 % num_ps`. The optimizer runs on the PSs.
"""
from __future__ import annotations

import functools
import threading
from types import SimpleNamespace

import torch
from torch import nn

from deeprec.distributed.allreduce import (DenseAllReduce, broadcast_parameters, join_process_group,
                                          leave_process_group, rendezvous_from_env)
from deeprec.distributed.ps.client import DENSE_MODES, PSClient, PSError, out_of_step
from deeprec.errors import ConfigError, check_choice
from deeprec.nn.collection import EmbeddingCollection, FusedLookup
from deeprec.nn.variable import EmbeddingVariable
from deeprec.nn.lookup import EmbeddingLookup, RowGather, assemble
from deeprec.optim.dense import OptimizerGroup, dense_optimizers
from deeprec.nn.lookup import merge_rows


ALLREDUCE_ADVICE = ("With --dense allreduce every worker must run (restart the job with --resume); --dense ps lets "
                    "the other workers go on")


class DeferredPush:
    """star_server_lite: the last step's push, held until it can ride with the next pull
    (whichever pulls first takes it; a lock, since async embedding pulls in the stage thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held = None

    def put(self, grads: dict, step: int):
        """Hold this push; returns the one still held before it (to be sent now), if any."""
        with self._lock:
            previous, self._held = self._held, (grads, step)
            return previous

    def take(self):
        with self._lock:
            held, self._held = self._held, None
            return held


class RemoteLookup(EmbeddingLookup):
    """Stands in for a FusedLookup of EmbeddingVariables: same inputs and outputs,
    rows pulled from and gradients kept for the PSs.

    With async embedding, `prefetch` pulls a staged batch's rows from the stage's
    runner thread; `forward` then finds them instead of calling the PSs."""

    # EmbeddingLookup: the PSs apply the pushed gradients, kept here (merged over micro-batches by
    # take_gradients) until PSUpdater pushes them; prefetch pulls rows ahead (async embedding)
    updates_in_backward = False
    can_prefetch = True
    prefetch_reads_rows = True
    holds_tables = False

    def __init__(self, client: PSClient, names: list[str], local: FusedLookup):
        super().__init__()
        self.client, self.names = client, names
        self.dim, self.max_norm, self.num_pooled = local.dim, local.max_norm, local.num_pooled
        self.pending: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # one entry per backward
        self._keys: list[torch.Tensor] = []
        self._prefetched: dict[int, tuple[object, torch.Tensor]] = {}  # id(keys) -> (keys, rows)
        self._lock = threading.Lock()
        self._token = torch.zeros(0, requires_grad=True)
        self.prefetch_hits = self.direct_pulls = 0
        self.deferred: DeferredPush | None = None  # star_server_lite: a push to carry with a training pull

    def _fetch(self, uniques, train: bool) -> torch.Tensor:
        held = self.deferred.take() if self.deferred is not None and train else None
        # with a held push (star_server_lite): last step's push and this pull in one round trip per PS
        return self.client.pull_rows(self.names, list(uniques), train=train, push=None if held is None else held[0])

    def prefetch(self, uniques, train: bool) -> None:
        rows = self._fetch(uniques, train)
        with self._lock:
            self._prefetched[id(uniques)] = (uniques, rows)  # the entry keeps `uniques` alive: ids stay unique

    def discard_prefetched(self) -> None:
        with self._lock:
            self._prefetched.clear()

    def _pull(self, uniques) -> torch.Tensor:
        self._keys = list(uniques)
        with self._lock:
            entry = self._prefetched.pop(id(uniques), None)
        if entry is not None and entry[0] is uniques:
            self.prefetch_hits += 1
            return entry[1]
        self.direct_pulls += 1
        return self._fetch(self._keys, self.training)

    def receive(self, rows: torch.Tensor, grad: torch.Tensor, keys: list) -> None:
        """The gradient of one forward's rows; `keys`: that forward's unique keys per table (a lookup
        called twice in one step hands each call's own keys)."""
        start = 0  # rows are 0..U-1 in table order
        for name, keys in zip(self.names, keys):
            n = keys.numel()
            if n:
                self.pending.setdefault(name, []).append((keys, grad[start:start + n]))
            start += n

    def take_gradients(self) -> dict:
        """{table: (unique keys, summed gradients)} of every backward since the last call."""
        grads = {}
        for name, parts in self.pending.items():  # micro-batches: rows seen in several backwards are merged
            grads[name] = parts[0] if len(parts) == 1 else merge_rows(torch.cat([k for k, _ in parts]),
                                                                      torch.cat([g for _, g in parts]))
        self.pending = {}
        return grads

    def forward(self, uniques, inverse, offsets, weights, counts, masks=()):
        values = self._pull(uniques)
        rows = RowGather.apply(self._token, values, torch.arange(values.shape[0]),
                               functools.partial(self.receive, keys=self._keys))  # this call's keys
        return assemble(rows, inverse, offsets, weights, masks, self.num_pooled, self.max_norm)


class RemoteVariable(RemoteLookup):
    """Stands in for a free EmbeddingVariable (`ev(ids)` in your own model): ids of any shape ->
    [*ids.shape, dim] rows pulled from the PSs, gradients kept for the push."""

    def __init__(self, client: PSClient, name: str, ev: EmbeddingVariable):
        super().__init__(client, [name], SimpleNamespace(dim=ev.embedding_dim, max_norm=None, num_pooled=0))

    def forward(self, ids):
        ids = torch.as_tensor(ids)
        keys, inverse = torch.unique(ids.reshape(-1).to(torch.int64), return_inverse=True)
        values = self._pull([keys])
        if self.training and torch.is_grad_enabled():
            values = RowGather.apply(self._token, values, torch.arange(values.shape[0]),
                                     functools.partial(self.receive, keys=self._keys))  # a shared EV: per call
        return values[inverse].reshape(*ids.shape, self.dim)


def ps_variables(model: nn.Module) -> dict[str, EmbeddingVariable]:
    """Every EmbeddingVariable of a one-process model under the name its rows have on the PSs: a
    collection's feature as '<collection path>.<feature>', a free one by its module path."""
    out, seen = {}, set()
    for prefix, module in model.named_modules():
        if isinstance(module, EmbeddingCollection):
            local = module.lookup
            if not all(local.dynamic):
                raise ConfigError(f"parameter-server training keeps EmbeddingVariables on the PSs: the "
                                  f"EmbeddingCollection {prefix or 'model'!r} has fixed-size tables (zoo models: "
                                  "--embedding variable; your own: EmbeddingFeature(num_embeddings=None))")
            for feature, ev in zip(local.features, local.variables):
                out[f"{prefix}.{feature.name}" if prefix else feature.name] = ev
                seen.add(id(ev))
    for prefix, module in model.named_modules():
        if isinstance(module, EmbeddingVariable) and id(module) not in seen:
            out[prefix] = module
    return out


def _replace_module(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Every reference to `old` among the submodules (a shared EmbeddingVariable may have several)."""
    for parent in model.modules():
        for key, child in list(parent._modules.items()):
            if child is old:
                parent._modules[key] = new


class PSUpdater:
    """The Updater (deeprec.runtime.updater) of a PS worker: embedding rows and their
    optimizer live on the PSs; this worker pulls, computes gradients and pushes them.

    Dense parameters: `dense="ps"` keeps them on the PSs too (pulled and pushed whole
    each step); `dense="allreduce"` replicates them on the workers, averages their
    gradients by all-reduce (deeprec.distributed.allreduce) and steps a local torch
    optimizer: only embedding rows travel to the PSs.

    The chief (worker 0) snapshots and restores the PSs; the other workers keep their
    reader position (and, with all-reduce, their dense replica) in `worker-<index>`
    under the checkpoint folder."""

    def __init__(self, model: nn.Module, client: PSClient, optimizer: str, lr: float, *, sync_workers: int = 1,
                 worker_index: int = 0, num_workers: int = 1, dense: str = "ps", master: str | None = None):
        check_choice("dense", dense, DENSE_MODES)
        self.model, self.client, self.step = model, client, 0
        self.worker_index, self.is_chief = worker_index, worker_index == 0
        client.sync_workers = sync_workers
        self.remotes: list[RemoteLookup] = []
        variables = ps_variables(model)
        embeddings = {n: ev.embedding_dim for n, ev in variables.items()}
        defaults = {n: ev._defaults for n, ev in variables.items()}
        names_of = {id(ev): n for n, ev in variables.items()}
        in_collections = {id(ev) for c in model.modules() if isinstance(c, EmbeddingCollection)
                          for ev in c.lookup.variables}
        for prefix, module in list(model.named_modules()):
            if isinstance(module, EmbeddingCollection):  # the local tables are dropped
                local = module.lookup
                module.lookup = RemoteLookup(client, [names_of[id(ev)] for ev in local.variables], local)
                self.remotes.append(module.lookup)
            elif isinstance(module, EmbeddingVariable) and id(module) not in in_collections:  # ev(ids)
                remote = RemoteVariable(client, names_of[id(module)], module)
                _replace_module(model, module, remote)
                self.remotes.append(remote)
        if not self.remotes:
            raise ConfigError("parameter-server training keeps embedding rows on the PSs: this model has no "
                              "EmbeddingVariable (zoo models: --embedding variable; your own: dr.EmbeddingVariable "
                              "or an EmbeddingCollection of them)")
        self.dense = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.dense_mode, self.allreduce, self.optimizer = dense, None, None
        self.deferred = DeferredPush()  # star_server_lite (async): rides with the next pull
        for remote in self.remotes:
            remote.deferred = self.deferred
        if dense == "allreduce":
            self.optimizer = OptimizerGroup(dense_optimizers(model, optimizer, lr))
            if num_workers > 1:
                dense_params = list(self.dense.values())
                join_process_group(rendezvous_from_env(worker_index, num_workers, master),
                                   dense_params[0].device if dense_params else torch.device("cpu"))
                broadcast_parameters(dense_params)  # the replicas start equal
                # one bucket after the backward; the workers still training count (their data may end first)
                self.allreduce = DenseAllReduce(dense_params, bucket_bytes=None, overlap=False, drain=True,
                                                advice=ALLREDUCE_ADVICE)
        client.wait_ready()
        self._registration = (embeddings, {} if dense == "allreduce" else {n: p.detach() for n, p in self.dense.items()},
                              optimizer, lr, defaults)
        client.register(*self._registration)

    def reregister(self) -> None:
        """Register again (a restarted PS has no variables; the others keep theirs)."""
        self.client.register(*self._registration)

    def reset(self) -> None:
        """Drop what this worker holds of the step in flight (gradients, a held push, prefetched rows):
        training goes back to a checkpoint."""
        self.deferred.take()
        for remote in self.remotes:
            remote.take_gradients()
            remote.discard_prefetched()
        for p in self.dense.values():
            p.grad = None

    # -- the step ------------------------------------------------------------------------
    def before_step(self) -> None:
        if self.client.sync_workers > 1:  # sync training: this step's pulls wait for the last update
            self.client.after_step = self.step
        if self.dense_mode == "ps":
            self.pull_dense()

    def pull_dense(self) -> None:
        if self.dense_mode != "ps":
            return
        held = self.deferred.take()
        if held is not None:  # star_server_lite: last step's push rides with this pull
            values = self.client.push_pull(held[0], {}, list(self.dense))
        else:
            values = self.client.pull({}, list(self.dense))
        with torch.no_grad():
            for name, p in self.dense.items():
                p.copy_(values[name])

    def apply(self) -> None:
        self.step += 1
        grads = {}
        for remote in self.remotes:
            grads.update(remote.take_gradients())
        if self.dense_mode == "allreduce":
            if self.allreduce is not None:
                self.allreduce.average_gradients()
            self.optimizer.step()
            self.optimizer.zero_grad()
        else:
            for name, p in self.dense.items():
                if p.grad is not None:
                    grads[name] = p.grad.to_dense() if p.grad.is_sparse else p.grad
                    p.grad = None
        if self.client.protocol == "star_server_lite" and self.client.sync_workers <= 1:
            held = self.deferred.put(grads, self.step)  # rides with the next step's first pull (or the flush)
            if held is not None:  # no pull took the previous one: send it now
                self.client.push(*held)
        else:
            self.client.push(grads, self.step)

    def discard(self) -> None:
        """Drop this step's gradients (a non-finite loss). The step still counts: with
        all-reduce this worker joins with zero gradients, so the replicas stay equal."""
        for remote in self.remotes:
            remote.take_gradients()
        for p in self.dense.values():
            p.grad = torch.zeros_like(p) if self.dense_mode == "allreduce" else None
        self.apply()

    def _flush(self) -> None:
        """Send a push still held back by star_server_lite (checkpoints, evaluation, the end)."""
        held = self.deferred.take()
        if held is not None:
            self.client.push(*held)

    def finish(self) -> None:
        """This worker's training is over: flush, and, with all-reduce, join the other
        workers' all-reduces until they have ended too."""
        self._flush()
        if self.allreduce is not None:
            self.allreduce.drain()
            leave_process_group()
            self.allreduce = None

    def prepare_eval(self) -> None:
        self._flush()
        self.pull_dense()

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The worker's dense model (its replica, or the PSs' values pulled) under "model", as a
        one-process checkpoint holds it (deeprec.distributed.ps.strategy.one_process_state merges the
        PSs' rows into it: evaluate and export read PS checkpoints); the chief adds every PS's rows."""
        if self.client.sync_workers > 1:  # sync: the snapshot holds this step's averaged update
            self.client.after_step = self.step
        self._flush()
        self.pull_dense()
        state = {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()}}
        if self.dense_mode == "allreduce":  # every worker keeps its (identical) replica
            state.update(dense={n: p.detach().clone() for n, p in self.dense.items()},
                         dense_optimizer=self.optimizer.state_dict())
        if self.is_chief:
            state["ps"] = self.client.snapshot()  # every PS's rows with their slots
        return state

    def load_state_dict(self, state: dict, wait: bool = True) -> None:
        """`wait` (non-chief workers): for the chief's restore of the PSs (a rollback has waited already)."""
        buffers = dict(self.model.named_buffers())
        with torch.no_grad():  # running statistics (batch norm) live only in the workers' checkpoints
            for name, value in state.get("model", {}).items():
                if name in buffers:
                    buffers[name].copy_(value)
        if "dense" in state:
            with torch.no_grad():
                for name, p in self.dense.items():
                    p.copy_(state["dense"][name])
            self.optimizer.load_state_dict(state["dense_optimizer"])
        if self.is_chief:
            self.client.restore(state["ps"], int(state["step"]))  # onto however many PSs run now
        elif wait:
            restored = self.client.wait_restored(self.client.deadline_s)
            if self.client.sync_workers > 1 and restored is not None and restored != int(state["step"]):
                raise PSError(out_of_step(restored, int(state["step"])))
