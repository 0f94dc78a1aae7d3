"""Worker side of the parameter server: routing, protocols, deadlines.

    grpc              one Pull and one Push call per (variable, PS) per step
    star_server       one fused Pull and one fused Push per PS per step, all PSs concurrently
    star_server_lite  one PushPull per PS: the push of step t rides with the pull of step t+1

Embedding keys go to PS `key % 1000 % num_ps`; dense variables to PS `crc32(name) % num_ps`.
A failed or late PS call raises PSError naming the PS; nothing waits forever.
"""
from __future__ import annotations

import concurrent.futures
import zlib

import grpc
import torch

from deeprec.distributed.ps_shard import GRPC_OPTIONS, SERVICE
from deeprec.distributed import security
from deeprec.distributed.tuning import core_number, pin_cores, pin_current_thread
from deeprec.distributed.wire import pack, unpack
from deeprec.errors import DeepRecError, check_choice
from deeprec.nn.variable import shard_of

PROTOCOLS = ("grpc", "star_server", "star_server_lite")


class PSError(DeepRecError):
    """A parameter-server call failed; names the PS and the gRPC status."""


class PSClient:
    def __init__(self, addresses: list[str], protocol: str = "star_server", deadline_s: float = 30.0,
                 threads: int | None = None):
        check_choice("protocol", protocol, PROTOCOLS)
        self.addresses, self.protocol, self.deadline_s = list(addresses), protocol, deadline_s
        self.channels = [security.channel(a, GRPC_OPTIONS) for a in self.addresses]
        self._metadata = security.call_metadata(security.read_token())  # DEEPREC_PS_TOKEN
        self._calls = {m: [ch.unary_unary(f"/{SERVICE}/{m}") for ch in self.channels]
                       for m in ("Register", "Pull", "Push", "PushPull", "Export", "Load", "Health")}
        # NETWORK_WORKER_CORE_NUMBER threads encode and decode; the pool has at least one
        # per PS so that star_server's fused calls reach every PS at once
        threads = threads or core_number("NETWORK_WORKER_CORE_NUMBER", len(addresses), 2)
        cores = pin_cores("WORKER", threads)  # WORKER_DISABLE_PIN_CORES=False
        self._pool = concurrent.futures.ThreadPoolExecutor(max(threads, len(addresses)),
                                                           thread_name_prefix="deeprec-ps-client",
                                                           initializer=pin_current_thread, initargs=(cores,))
        self.dims: dict[str, int] = {}
        self.after_step: int | None = None  # sync training: pulls wait for this step's update
        self.sync_workers = 1
        self.bytes_sent = self.bytes_received = self.calls = 0

    @property
    def num_ps(self) -> int:
        return len(self.addresses)

    def dense_owner(self, name: str) -> int:
        return zlib.crc32(name.encode()) % self.num_ps

    # -- calls -----------------------------------------------------------------------------
    def _invoke(self, method: str, ps: int, header: dict, tensors: dict) -> tuple[dict, dict]:
        if method in ("Pull", "PushPull") and self.after_step is not None:
            header = {**header, "after_step": self.after_step}
        request = pack(header, tensors)
        try:
            reply = self._calls[method][ps](request, timeout=self.deadline_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise PSError(f"PS {ps} at {self.addresses[ps]}: {method} failed: {err.code().name}: "
                          f"{err.details()}") from None
        self.bytes_sent += len(request)
        self.bytes_received += len(reply)
        self.calls += 1
        return unpack(reply)

    def _fan_out(self, jobs: list[tuple[str, int, dict, dict]]) -> list[tuple[dict, dict]]:
        futures = [self._pool.submit(self._invoke, *job) for job in jobs]
        return [f.result() for f in futures]

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        for ps, channel in enumerate(self.channels):
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout_s)
            except grpc.FutureTimeoutError:
                raise PSError(f"PS {ps} at {self.addresses[ps]} not reachable within {timeout_s:.0f}s") from None

    def register(self, embeddings: dict[str, int], dense: dict[str, torch.Tensor], optimizer: str = "adagrad",
                 lr: float = 0.01, defaults: dict[str, torch.Tensor] | None = None) -> None:
        """Create variables on the PSs (idempotent): {name: dim} and {name: initial value};
        `defaults` gives an embedding's initializer matrix (row key % n starts a new key)."""
        self.dims.update(embeddings)
        jobs = []
        for ps in range(self.num_ps):
            specs = [{"name": n, "kind": "embedding", "dim": d, "optimizer": optimizer, "lr": lr}
                     for n, d in embeddings.items()]
            mine = {n: v for n, v in dense.items() if self.dense_owner(n) == ps}
            specs += [{"name": n, "kind": "dense", "optimizer": optimizer, "lr": lr} for n in mine]
            tensors = {f"init/{n}": v for n, v in mine.items()}
            tensors.update({f"defaults/{n}": m for n, m in (defaults or {}).items()})
            jobs.append(("Register", ps, {"variables": specs}, tensors))
        self._fan_out(jobs)

    def _route(self, keys: dict[str, torch.Tensor]):
        """Per PS: {name: keys}, plus where each key's row goes back."""
        per_ps = [dict() for _ in range(self.num_ps)]
        where = {}
        for name, k in keys.items():
            owner = shard_of(k, self.num_ps)
            where[name] = []
            for ps in range(self.num_ps):
                idx = torch.nonzero(owner == ps).squeeze(1)
                if idx.numel():
                    per_ps[ps][name] = k[idx]
                    where[name].append((ps, idx))
        return per_ps, where

    def _pull_jobs(self, per_ps, dense: list[str], train: bool):
        """One fused Pull per PS holding any of the keys or dense variables."""
        jobs = []
        for ps in range(self.num_ps):
            names = list(per_ps[ps]) + [n for n in dense if self.dense_owner(n) == ps]
            if names:
                jobs.append(("Pull", ps, {"vars": names, "train": train},
                             {f"keys/{n}": k for n, k in per_ps[ps].items()}))
        return jobs

    def _assemble(self, keys, where, replies_by_ps: dict[int, dict], dense: list[str]) -> dict:
        out = {}
        for name, k in keys.items():
            values = torch.empty(k.numel(), self.dims[name])
            for ps, idx in where[name]:
                values[idx] = replies_by_ps[ps][f"values/{name}"]
            out[name] = values
        for name in dense:
            out[name] = replies_by_ps[self.dense_owner(name)][f"values/{name}"]
        return out

    def pull(self, keys: dict[str, torch.Tensor], dense: list[str] = (), train: bool = True) -> dict[str, torch.Tensor]:
        """Rows of each embedding's (unique) keys and the dense variables' values."""
        per_ps, where = self._route(keys)
        replies: dict[int, dict] = {}
        if self.protocol == "grpc":  # one call per variable per PS
            jobs = [("Pull", ps, {"vars": [n], "train": train}, {f"keys/{n}": k}) for ps in range(self.num_ps)
                    for n, k in per_ps[ps].items()]
            jobs += [("Pull", self.dense_owner(n), {"vars": [n]}, {}) for n in dense]
            for (_, ps, _, _), (_, tensors) in zip(jobs, self._fan_out(jobs)):
                replies.setdefault(ps, {}).update(tensors)
        else:
            jobs = self._pull_jobs(per_ps, list(dense), train)
            for (_, ps, _, _), (_, tensors) in zip(jobs, self._fan_out(jobs)):
                replies[ps] = tensors
        return self._assemble(keys, where, replies, list(dense))

    def _push_tensors(self, grads: dict, prefix: str = ""):
        per_ps = [dict() for _ in range(self.num_ps)]
        for name, g in grads.items():
            if isinstance(g, tuple):  # embedding: (unique keys, grads)
                k, rows = g
                owner = shard_of(k, self.num_ps)
                for ps in range(self.num_ps):
                    idx = torch.nonzero(owner == ps).squeeze(1)
                    if idx.numel():
                        per_ps[ps][name] = {f"{prefix}keys/{name}": k[idx], f"{prefix}grads/{name}": rows[idx]}
            else:
                per_ps[self.dense_owner(name)][name] = {f"{prefix}grads/{name}": g.float()}
        return per_ps

    def push(self, grads: dict, step: int | None = None) -> None:
        """{name: (keys, grads)} for embeddings, {name: grad} for dense variables.
        Sync training (`sync_workers` > 1) sends one fused push to every PS per step."""
        per_ps = self._push_tensors(grads)
        if self.sync_workers > 1:
            if self.protocol == "grpc":
                raise PSError("sync training needs a fused protocol (star_server or star_server_lite)")
            self._fan_out([("Push", ps, {"vars": list(per_ps[ps]), "step": step, "workers": self.sync_workers},
                            {k: v for t in per_ps[ps].values() for k, v in t.items()}) for ps in range(self.num_ps)])
            return
        if self.protocol == "grpc":
            jobs = [("Push", ps, {"vars": [n]}, t) for ps in range(self.num_ps) for n, t in per_ps[ps].items()]
        else:
            jobs = [("Push", ps, {"vars": list(per_ps[ps])}, {k: v for t in per_ps[ps].values() for k, v in t.items()})
                    for ps in range(self.num_ps) if per_ps[ps]]
        self._fan_out(jobs)

    def push_pull(self, grads: dict, keys: dict[str, torch.Tensor], dense: list[str] = ()) -> dict:
        """star_server_lite: this step's push and the next step's pull in one round trip per PS."""
        if self.protocol != "star_server_lite":
            self.push(grads)
            return self.pull(keys, dense)
        push_per_ps = self._push_tensors(grads, "push.")
        pull_per_ps, where = self._route(keys)
        jobs = []
        for ps in range(self.num_ps):
            pull_names = list(pull_per_ps[ps]) + [n for n in dense if self.dense_owner(n) == ps]
            tensors = {k: v for t in push_per_ps[ps].values() for k, v in t.items()}
            tensors.update({f"pull.keys/{n}": k for n, k in pull_per_ps[ps].items()})
            if pull_names or push_per_ps[ps]:
                jobs.append(("PushPull", ps, {"push": list(push_per_ps[ps]), "pull": pull_names}, tensors))
        replies = {}
        for (_, ps, _, _), (_, tensors) in zip(jobs, self._fan_out(jobs)):
            replies[ps] = tensors
        return self._assemble(keys, where, replies, list(dense))

    def export(self) -> list[dict]:
        return [t for _, t in self._fan_out([("Export", ps, {}, {}) for ps in range(self.num_ps)])]

    def snapshot(self) -> dict:
        """All PSs' variables merged into one state (rows concatenated, dense from its owner)."""
        merged: dict[str, list] = {}
        for part in self.export():
            for key, value in part.items():
                merged.setdefault(key, []).append(value)
        out = {}
        for key, values in merged.items():
            out[key] = torch.cat(values) if key.startswith("emb/") and values[0].dim() > 0 else values[0]
        return out

    def restore(self, state: dict) -> None:
        """Load a snapshot into every PS (each keeps its shard: any PS count works)."""
        self._fan_out([("Load", ps, {}, state) for ps in range(self.num_ps)])

    def wait_restored(self, timeout_s: float) -> None:
        """Block until every PS has taken a checkpoint restore (resuming non-chief workers)."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            if all(h.get("generation", 0) > 0 for h, _ in self._fan_out(
                    [("Health", ps, {}, {}) for ps in range(self.num_ps)])):
                return
            if time.monotonic() > deadline:
                raise PSError(f"the PSs were not restored from a checkpoint within {timeout_s:.0f}s")
            time.sleep(0.2)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for channel in self.channels:
            channel.close()
