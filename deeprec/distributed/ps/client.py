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

from deeprec.distributed.ps.shard import GRPC_OPTIONS, SERVICE
from deeprec.distributed.ps import security
from deeprec.security import read_token
from deeprec.distributed.ps.tuning import core_number, pin_cores, pin_current_thread
from deeprec.distributed.ps.wire import pack, unpack
from deeprec.errors import DeepRecError, check_choice
from deeprec.nn.variable import shard_of

from deeprec.choices import DENSE_MODES, PROTOCOLS  # noqa: E402  (re-exported)


class PSError(DeepRecError):
    """A parameter-server call failed; names the PS and the gRPC status."""


class PSClient:
    def __init__(self, addresses: list[str], protocol: str = "star_server", deadline_s: float = 30.0,
                 threads: int | None = None):
        check_choice("protocol", protocol, PROTOCOLS)
        self.addresses, self.protocol, self.deadline_s = list(addresses), protocol, deadline_s
        self.channels = [security.channel(a, GRPC_OPTIONS) for a in self.addresses]
        self._metadata = security.call_metadata(read_token())  # DEEPREC_PS_TOKEN
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
        reply = self._invoke_once(method, ps, header, tensors)
        if method == "Pull" and "rows" in reply[0]:  # an evaluation pull past the PS's reply bound
            return self._pull_rest(ps, header, tensors, reply)
        return reply

    def _pull_rest(self, ps: int, header: dict, tensors: dict, first: tuple[dict, dict]) -> tuple[dict, dict]:
        """The rest of a chunked evaluation Pull: the remaining keys, in windows of the rows the PS answered
        first (each reply again under its bound; a shorter one says so, and the next window starts there)."""
        keys, counts = tensors["keys"], tensors["counts"]
        last = torch.cumsum(counts, 0)
        values = {k: [v] for k, v in first[1].items() if k.startswith("values/")}
        done = window = int(first[0]["rows"])
        request = {"embeddings": header["embeddings"], "dense": [], "train": False}
        while done < keys.numel():
            if window < 1:
                raise PSError(f"PS {ps} at {self.addresses[ps]}: Pull answered no rows of a chunked evaluation pull")
            end = min(keys.numel(), done + window)
            part = torch.clamp(torch.clamp(last, max=end) - torch.clamp(last - counts, min=done), min=0)
            reply_header, reply = self._invoke_once("Pull", ps, request, {"keys": keys[done:end], "counts": part})
            for k, v in reply.items():
                values.setdefault(k, []).append(v)
            window = int(reply_header.get("rows", end - done))
            done += window
        return first[0], {**first[1], **{k: torch.cat(v) for k, v in values.items()}}

    def _invoke_once(self, method: str, ps: int, header: dict, tensors: dict) -> tuple[dict, dict]:
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

    def _pull_jobs(self, routing: "_Routing | None", dense: list[str], train: bool,
                   prefix: str = "") -> dict[int, tuple[dict, dict]]:
        """{ps: (header, tensors)}: the fused rows and dense variables of each PS concerned."""
        jobs = {}
        for ps in range(self.num_ps):
            header, tensors = {"train": train}, {}
            if routing is not None and routing.reaches(ps):
                header["embeddings"] = routing.names
                tensors = routing.tensors(ps, prefix)
            header["dense"] = [n for n in dense if self.dense_owner(n) == ps]
            if "embeddings" in header or header["dense"]:
                jobs[ps] = (header, tensors)
        return jobs

    def _call_all(self, method: str, jobs: dict[int, tuple[dict, dict]]) -> dict[int, dict]:
        replies = self._fan_out([(method, ps, h, t) for ps, (h, t) in jobs.items()])
        return {ps: tensors for ps, (_, tensors) in zip(jobs, replies)}

    def pull(self, keys: dict[str, torch.Tensor], dense: list[str] = (), train: bool = True) -> dict[str, torch.Tensor]:
        """Rows of each embedding's (unique) keys and the dense variables' values."""
        dense = list(dense)
        if self.protocol == "grpc":  # one call per variable per PS
            out = {}
            for name, k in keys.items():
                routing = _Routing(self, {name: k})
                out.update(routing.split(routing.assemble(self._call_all("Pull", self._pull_jobs(routing, [], train)))))
            for name in dense:
                out.update(self._dense_values(self._call_all("Pull", self._pull_jobs(None, [name], train)), [name]))
            return out
        routing = _Routing(self, keys) if keys else None
        replies = self._call_all("Pull", self._pull_jobs(routing, dense, train))
        out = routing.split(routing.assemble(replies)) if routing else {}
        out.update(self._dense_values(replies, dense))
        return out

    def pull_rows(self, names: list[str], keys: list[torch.Tensor], train: bool = True,
                  push: dict | None = None) -> torch.Tensor:
        """Rows of tables of one dim, concatenated in `names` order: [sum of keys, dim].
        `push` (star_server_lite): gradients sent in the same round trip, before the pull."""
        routing = _Routing(self, dict(zip(names, keys)))
        if len(routing.dims) != 1 or routing.names != list(names):
            raise PSError(f"pull_rows needs tables of one dim, got dims {routing.dims}")
        if push is None:
            replies = self._call_all("Pull", self._pull_jobs(routing, [], train))
        else:
            replies = self._call_all("PushPull", self._push_pull_jobs(push, routing, []))
        return routing.assemble(replies)[routing.dims[0]]

    def _dense_values(self, replies: dict[int, dict], dense: list[str]) -> dict:
        return {n: replies[self.dense_owner(n)][f"dense/{n}"] for n in dense}

    def _push_jobs(self, grads: dict, prefix: str = "", header: dict | None = None) -> dict[int, tuple[dict, dict]]:
        rows = {n: g for n, g in grads.items() if isinstance(g, tuple)}  # embedding: (unique keys, grads)
        routing = _Routing(self, {n: k for n, (k, _) in rows.items()}, {n: g for n, (_, g) in rows.items()}) \
            if rows else None
        jobs = {}
        for ps in range(self.num_ps):
            dense = [n for n, g in grads.items() if not isinstance(g, tuple) and self.dense_owner(n) == ps]
            tensors = {f"{prefix}dense/{n}": grads[n].float() for n in dense}
            part = {"dense": dense, **(header or {})}
            if routing is not None and routing.reaches(ps):
                part["embeddings"] = routing.names
                tensors.update(routing.tensors(ps, prefix))
            if "embeddings" in part or part["dense"] or self.sync_workers > 1:  # sync: every PS counts every step
                jobs[ps] = (part, tensors)
        return jobs

    def push(self, grads: dict, step: int | None = None) -> None:
        """{name: (keys, grads)} for embeddings, {name: grad} for dense variables.
        Sync training (`sync_workers` > 1) sends one fused push to every PS per step."""
        if self.sync_workers > 1:
            if self.protocol == "grpc":
                raise PSError("sync training needs a fused protocol (star_server or star_server_lite)")
            self._call_all("Push", self._push_jobs(grads, header={"step": step, "workers": self.sync_workers}))
            return
        if self.protocol == "grpc":
            for name, g in grads.items():
                self._call_all("Push", self._push_jobs({name: g}))
            return
        self._call_all("Push", self._push_jobs(grads))

    def push_pull(self, grads: dict, keys: dict[str, torch.Tensor], dense: list[str] = ()) -> dict:
        """star_server_lite: this step's push and the next step's pull in one round trip per PS."""
        if self.protocol != "star_server_lite":
            self.push(grads)
            return self.pull(keys, dense)
        dense = list(dense)
        routing = _Routing(self, keys) if keys else None
        replies = self._call_all("PushPull", self._push_pull_jobs(grads, routing, dense))
        out = routing.split(routing.assemble(replies)) if routing else {}
        out.update(self._dense_values(replies, dense))
        return out

    def _push_pull_jobs(self, grads: dict, routing: "_Routing | None", dense: list[str]) -> dict:
        pushes, pulls = self._push_jobs(grads, "push."), self._pull_jobs(routing, dense, True, prefix="pull.")
        jobs = {}
        for ps in sorted({*pushes, *pulls}):
            push, pull = pushes.get(ps, ({}, {})), pulls.get(ps, ({}, {}))
            jobs[ps] = ({"push": push[0], "pull": pull[0]}, {**push[1], **pull[1]})
        return jobs

    def export(self, after_versions: list[dict] | None = None) -> list[dict]:
        """Each PS's variables; `after_versions[ps]` {variable: step}: only rows that PS updated after
        that step of the variable's optimizer there (row versions are per PS)."""
        headers = [{} if not after_versions or not after_versions[ps] else {"after_version": after_versions[ps]}
                   for ps in range(self.num_ps)]
        return [t for _, t in self._fan_out([("Export", ps, headers[ps], {}) for ps in range(self.num_ps)])]

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


class _Routing:
    """Where each row of a request goes: tables ordered by dim (each dim's rows one
    contiguous span), one fused slice of keys per PS, and back."""

    def __init__(self, client: PSClient, keys: dict[str, torch.Tensor], grads: dict | None = None):
        self.num_ps = client.num_ps
        self.names = sorted(keys, key=lambda n: client.dims[n])
        sizes = [keys[n].numel() for n in self.names]
        self.sizes = sizes
        self.flat = torch.cat([keys[n].reshape(-1) for n in self.names])
        dims = self.table_dims = [client.dims[n] for n in self.names]
        self.dims = list(dict.fromkeys(dims))
        self.spans, offset = {}, 0  # dim -> [start, end) of its tables' rows
        for d, n in zip(dims, sizes):
            start = self.spans.get(d, (offset, offset))[0]
            offset += n
            self.spans[d] = (start, offset)
        self.grads = None if grads is None else {
            d: torch.cat([grads[n].reshape(-1, d) for n, nd in zip(self.names, dims) if nd == d]).float()
            for d in self.dims}
        if self.num_ps == 1:
            self.index, self.counts = [None], [torch.tensor(sizes, dtype=torch.int64)]
            return
        owner = shard_of(self.flat, self.num_ps)
        var = torch.repeat_interleave(torch.arange(len(self.names)), torch.tensor(sizes, dtype=torch.int64))
        self.index = [torch.nonzero(owner == ps).squeeze(1) for ps in range(self.num_ps)]
        self.counts = [torch.bincount(var[i], minlength=len(self.names)) for i in self.index]

    def reaches(self, ps: int) -> bool:
        return self.index[ps] is None or self.index[ps].numel() > 0

    def _within(self, ps: int, dim: int) -> torch.Tensor:
        """Positions, within `dim`'s span, of the rows PS `ps` holds."""
        index, (start, end) = self.index[ps], self.spans[dim]
        lo, hi = torch.searchsorted(index, torch.tensor([start, end])).tolist()
        return index[lo:hi] - start

    def tensors(self, ps: int, prefix: str) -> dict:
        index = self.index[ps]
        out = {f"{prefix}keys": self.flat if index is None else self.flat[index], f"{prefix}counts": self.counts[ps]}
        for d, g in (self.grads or {}).items():
            out[f"{prefix}grads/{d}"] = g if index is None else g[self._within(ps, d)]
        return out

    def assemble(self, replies: dict[int, dict]) -> dict[int, torch.Tensor]:
        """{dim: rows of every table of that dim, in order}."""
        if self.num_ps == 1:
            return {d: replies[0][f"values/{d}"] for d in self.dims}
        out = {}
        for d, (start, end) in self.spans.items():
            out[d] = torch.empty(end - start, d)
            for ps, tensors in replies.items():
                if f"values/{d}" in tensors:
                    out[d][self._within(ps, d)] = tensors[f"values/{d}"]
        return out

    def split(self, by_dim: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{table: its rows}: views of the per-dim tensors."""
        out, offset = {}, {d: 0 for d in self.dims}
        for name, n, d in zip(self.names, self.sizes, self.table_dims):
            out[name] = by_dim[d][offset[d]:offset[d] + n]
            offset[d] += n
        return out
