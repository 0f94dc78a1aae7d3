"""Training a model whose parameters live on the parameter servers.

    step:  pull dense parameters ──> forward (each EmbeddingCollection pulls its
           rows: one fused call per PS) ──> backward (embedding gradients are
           captured, not applied) ──> one push of all gradients; the PSs update

Embeddings must be EmbeddingVariables (`embedding="variable"`): their keys are
partitioned over the PSs by `key % 1000 % num_ps`. The optimizer runs on the PSs.
"""
from __future__ import annotations

import threading

import torch
from torch import nn

from deeprec.distributed.client import PSClient
from deeprec.errors import ConfigError
from deeprec.nn.collection import EmbeddingCollection
from deeprec.optim.sparse import merge_rows


class RemoteTables:
    """Stands in for a collection's EmbeddingVariables: rows come from and go to the PSs.

    With async embedding, `prefetch` pulls a staged batch's rows from the stage's
    runner thread; the step's `pull` then finds them instead of calling the PSs."""

    def __init__(self, client: PSClient, names: list[str]):
        self.client, self.names = client, names
        self.pending: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # one entry per backward
        self._keys: list[torch.Tensor] = []
        self._prefetched: dict[int, tuple[object, torch.Tensor]] = {}  # id(keys) -> (keys, rows)
        self._lock = threading.Lock()
        self.prefetch_hits = self.direct_pulls = 0

    def _fetch(self, uniques, train: bool) -> torch.Tensor:
        values = self.client.pull(dict(zip(self.names, uniques)), train=train)
        return torch.cat([values[n] for n in self.names])

    def prefetch(self, uniques, train: bool) -> None:
        rows = self._fetch(uniques, train)
        with self._lock:
            self._prefetched[id(uniques)] = (uniques, rows)  # the entry keeps `uniques` alive: ids stay unique

    def discard_prefetched(self) -> None:
        with self._lock:
            self._prefetched.clear()

    def pull(self, uniques, train: bool) -> torch.Tensor:
        self._keys = list(uniques)
        with self._lock:
            entry = self._prefetched.pop(id(uniques), None)
        if entry is not None and entry[0] is uniques:
            self.prefetch_hits += 1
            return entry[1]
        self.direct_pulls += 1
        return self._fetch(self._keys, train)

    def receive(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        start = 0  # rows are 0..U-1 in feature order (see FusedLookup.forward)
        for name, keys in zip(self.names, self._keys):
            n = keys.numel()
            if n:
                self.pending.setdefault(name, []).append((keys, grad[start:start + n]))
            start += n


class PSSession:
    """Registers a model's variables on the PSs and runs its pulls and pushes."""

    def __init__(self, model: nn.Module, client: PSClient, optimizer: str, lr: float):
        self.model, self.client = model, client
        self.remotes: list[RemoteTables] = []
        embeddings, defaults = {}, {}
        for prefix, module in model.named_modules():
            if isinstance(module, EmbeddingCollection):
                lookup = module.lookup
                if not all(lookup.dynamic):
                    raise ConfigError("parameter-server training needs EmbeddingVariables: "
                                      "build the model with embedding='variable'")
                names = [f"{prefix}.{f.name}" for f in lookup.features]
                remote = RemoteTables(client, names)
                lookup.remote = remote
                self.remotes.append(remote)
                embeddings.update({n: lookup.dim for n in names})
                defaults.update({n: ev._defaults for n, ev in zip(names, lookup.variables)})
        self.dense = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self._deferred = None
        client.wait_ready()
        client.register(embeddings, {n: p.detach() for n, p in self.dense.items()}, optimizer, lr, defaults)

    def begin_step(self, step: int) -> None:
        """Sync training: this step's pulls wait until the previous step is applied everywhere."""
        if self.client.sync_workers > 1:
            self.client.after_step = step - 1

    def pull_dense(self) -> None:
        if self._deferred is not None:  # star_server_lite: last step's push rides with this pull
            grads, _ = self._deferred
            self._deferred = None
            values = self.client.push_pull(grads, {}, list(self.dense))
        else:
            values = self.client.pull({}, list(self.dense))
        with torch.no_grad():
            for name, p in self.dense.items():
                p.copy_(values[name])

    def push(self, step: int | None = None) -> None:
        grads = {}
        for remote in self.remotes:  # micro-batches: rows seen in several backwards are merged
            for name, parts in remote.pending.items():
                grads[name] = parts[0] if len(parts) == 1 else merge_rows(torch.cat([k for k, _ in parts]),
                                                                          torch.cat([g for _, g in parts]))
            remote.pending = {}
        for name, p in self.dense.items():
            if p.grad is not None:
                grads[name] = p.grad.to_dense() if p.grad.is_sparse else p.grad
                p.grad = None
        if self.client.protocol == "star_server_lite" and self.client.sync_workers <= 1:
            self._deferred = (grads, step)  # sent with the next step's pull (or by flush)
        else:
            self.client.push(grads, step)

    def flush(self) -> None:
        """Send a push still held back by star_server_lite (end of training, checkpoints)."""
        if self._deferred is not None:
            grads, step = self._deferred
            self._deferred = None
            self.client.push(grads, step)
