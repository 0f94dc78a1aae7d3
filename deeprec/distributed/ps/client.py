"""Worker side of the parameter server: routing, protocols, deadlines.

    grpc              one Pull and one Push call per (variable, PS) per step
    star_server       one fused Pull and one fused Push per PS per step, all PSs concurrently
    star_server_lite  one PushPull per PS: the push of step t rides with the pull of step t+1

Embedding keys go to PS `key % 1000 % num_ps`; dense variables to PS `crc32(name) % num_ps`.
A PS that does not answer (a partition, a restart) is retried until the total deadline
(--ps-deadline): each attempt is bounded, keepalive pings notice a dead connection, and every
training Push / Pull and every Load carries (client id, sequence number) so a retry of a request the
PS already ran gets its first reply instead of running twice (exactly-once), and "done" (every
earlier seq answered) so the PS keeps only the replies of calls in flight. Past the deadline, or on any
other failure, PSError names the PS; a PS that restarted or was rolled back raises PSRolledBack.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
import uuid
import zlib

import grpc
import torch

from deeprec.distributed.ps.keyless import LastPulls, same_keys
from deeprec.distributed.ps.shard import GRPC_OPTIONS, SERVICE
from deeprec.distributed.ps import security
from deeprec.security import read_token
from deeprec.distributed.ps.tuning import core_number, pin_cores, pin_current_thread
from deeprec.distributed.ps.routing import Routing as _Routing
from deeprec.distributed.ps.wire import pack, unpack
from deeprec.errors import DeepRecError, check_choice

from deeprec.choices import DENSE_MODES, PROTOCOLS  # noqa: E402  (re-exported)


log = logging.getLogger("deeprec.ps")
RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# keepalive: a connection whose packets are silently dropped is declared dead after ~5 s (not TCP's
# 15 minutes), so the retry opens a new one; reconnects back off at most 2 s, so a link that comes
# back is used within seconds (gRPC's default backoff grows to 120 s)
CLIENT_OPTIONS = GRPC_OPTIONS + [("grpc.keepalive_time_ms", 2000), ("grpc.keepalive_timeout_ms", 3000),
                                 ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
                                 ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                                 ("grpc.max_reconnect_backoff_ms", 2000)]


class PSError(DeepRecError):
    """A parameter-server call failed; names the PS and the gRPC status."""


class _PullGone(PSError):
    """NOT_FOUND: the PS no longer holds the pull a keyless push refers to (the push is sent again with its keys)."""


class PSRolledBack(PSError):
    """A PS restarted (its rows are gone) or was restored from a checkpoint since this worker last
    registered: the worker's view of the model no longer matches it (training rolls back)."""

    def __init__(self, message: str, ps: int):
        super().__init__(message)
        self.ps = ps


def out_of_step(restored: int, own: int | None) -> str:
    """A sync worker whose newest checkpoint is not of the step the chief restored the PSs to (its save
    of that step was cut): going on from another step would leave it out of step with the others."""
    has = f"its newest checkpoint is of step {own}" if own is not None else "it has no checkpoint"
    return (f"the chief restored the PSs to step {restored}, but {has}: sync workers go on from one step; "
            f"remove the chief's checkpoints after the newest step every worker saved, then --resume")


class PSClient:
    def __init__(self, addresses: list[str], protocol: str = "star_server", deadline_s: float = 60.0,
                 threads: int | None = None, attempt_s: float | None = None):
        """`deadline_s`: how long one call is retried (--ps-deadline); `attempt_s`: one attempt's bound
        (default: a quarter of it, 5 to 15 s: a sync pull may wait that long for the other workers)."""
        check_choice("protocol", protocol, PROTOCOLS)
        self.addresses, self.protocol, self.deadline_s = list(addresses), protocol, deadline_s
        self.attempt_s = attempt_s or min(deadline_s, max(5.0, min(15.0, deadline_s / 4)))
        self.channels = [security.channel(a, CLIENT_OPTIONS) for a in self.addresses]
        self._metadata = security.call_metadata(read_token())  # DEEPREC_PS_TOKEN
        self._calls = {m: [ch.unary_unary(f"/{SERVICE}/{m}") for ch in self.channels]
                       for m in ("Register", "Pull", "Push", "PushPull", "Export", "Load", "Health")}
        # NETWORK_WORKER_CORE_NUMBER threads encode and decode; the pool has at least two per PS so
        # that star_server's fused calls reach every PS at once, even beside an abandoned call's attempt
        threads = threads or core_number("NETWORK_WORKER_CORE_NUMBER", len(addresses), 2)
        cores = pin_cores("WORKER", threads)  # WORKER_DISABLE_PIN_CORES=False
        self._pool = concurrent.futures.ThreadPoolExecutor(max(threads, 2 * len(addresses)),
                                                           thread_name_prefix="deeprec-ps-client",
                                                           initializer=pin_current_thread, initargs=(cores,))
        self.dims: dict[str, int] = {}
        self.after_step: int | None = None  # sync training: pulls wait for this step's update
        self.sync_workers = 1
        self.bytes_sent = self.bytes_received = self.calls = 0
        self.id, self._seq, self._seq_lock = uuid.uuid4().hex, itertools.count(1), threading.Lock()
        self._waiting: set[int] = set()  # seqs of the calls in flight
        # per PS: [incarnation, generation] it answered at Register / Load; sent with every request,
        # a PS that restarted or was restored since answers FAILED_PRECONDITION (PSRolledBack)
        self.expect: list[list | None] = [None] * len(self.addresses)
        self.retries = 0  # calls that needed more than one attempt
        self._local = threading.local()
        self._pulls = LastPulls(len(self.addresses))  # a push of a kept pull's keys sends none (keyless.py)

    @property
    def num_ps(self) -> int:
        return len(self.addresses)

    def dense_owner(self, name: str) -> int:
        return zlib.crc32(name.encode()) % self.num_ps

    # -- calls -----------------------------------------------------------------------------
    def _invoke(self, method: str, ps: int, header: dict, tensors: dict,
                abandon: threading.Event | None = None) -> tuple[dict, dict]:
        self._local.abandon = abandon  # read by _invoke_once's retries (its signature stays 4 arguments)
        if method in ("Pull", "PushPull", "Export") and self.after_step is not None:
            header = {**header, "after_step": self.after_step}
        seq, noted = None, None
        if method in ("Push", "PushPull", "Load") or (method == "Pull" and header.get("train", True)):
            with self._seq_lock:  # changes the PS: exactly once, however often it is sent
                seq = next(self._seq)
                self._waiting.add(seq)  # "done": the seqs below the oldest one in flight (the PS drops their replies)
                header = {**header, "client": self.id, "seq": seq, "done": min(self._waiting) - 1}
                noted = self._pulls.sent(method, ps, seq, header, tensors)
        if method not in ("Register", "Load", "Health") and self.expect[ps] is not None:
            header = {**header, "expect": self.expect[ps]}
        last = noted if method == "Push" else None
        keyless = same_keys(last, header, tensors)
        try:
            if keyless:
                try:
                    reply = self._invoke_once(method, ps, {**header, "pulled": last[0]},
                                              {k: v for k, v in tensors.items() if k not in ("keys", "counts")})
                except _PullGone:  # refused, not run: the same request with its keys
                    reply = self._invoke_once(method, ps, header, tensors)
            else:
                reply = self._invoke_once(method, ps, header, tensors)
        finally:
            if seq is not None:
                with self._seq_lock:
                    self._waiting.discard(seq)
        if method == "Pull" and noted is not None:
            with self._seq_lock:
                self._pulls.answered(ps, noted, reply[0])
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
        """One call, retried while the PS is unreachable or late (each attempt bounded, backing off)
        until `deadline_s` has passed since the first, or the fan-out is abandoned (another PS of the
        same call failed); every other failure is raised at once. A waiting sync pull refused because
        others wait (RESOURCE_EXHAUSTED) is retried too: its own earlier attempt may still hold a place."""
        request, started, pause = pack(header, tensors), time.monotonic(), 0.1
        abandon = getattr(self._local, "abandon", None)
        retried = RETRIED + ((grpc.StatusCode.RESOURCE_EXHAUSTED,) if "after_step" in header else ())
        where = f"PS {ps} at {self.addresses[ps]}"
        while True:
            left = started + self.deadline_s - time.monotonic()
            try:
                reply = self._calls[method][ps](request, timeout=max(0.05, min(self.attempt_s, left)),
                                                metadata=self._metadata)
                break
            except grpc.RpcError as err:
                code, waited = err.code(), time.monotonic() - started
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    raise PSRolledBack(f"{where}: {err.details()}", ps) from None
                if code == grpc.StatusCode.NOT_FOUND and "pulled" in header:
                    raise _PullGone(f"{where}: {err.details()}") from None
                if code not in retried:
                    raise PSError(f"{where}: {method} failed: {code.name}: {err.details()}") from None
                if abandon is not None and abandon.is_set():
                    raise PSError(f"{where}: {method} abandoned: another PS of the same call failed") from None
                if waited >= self.deadline_s - 0.05:
                    raise PSError(f"{where}: {method} not answered for {waited:.0f} s (--ps-deadline "
                                  f"{self.deadline_s:g}): {code.name}: {err.details()}") from None
                if pause == 0.1:
                    self.retries += 1
                    log.warning("%s: %s unanswered (%s), retrying until %s", where, method, code.name,
                                time.strftime("%H:%M:%S", time.localtime(time.time() + self.deadline_s - waited)))
            time.sleep(max(0.0, min(pause, started + self.deadline_s - time.monotonic() - 0.05)))
            pause = min(1.0, pause * 2)
        if pause > 0.1:
            log.warning("%s: %s answered again after %.1f s", where, method, time.monotonic() - started)
        self.bytes_sent += len(request)
        self.bytes_received += len(reply)
        self.calls += 1
        return unpack(reply)

    def _fan_out(self, jobs: list[tuple[str, int, dict, dict]]) -> list[tuple[dict, dict]]:
        """The calls, concurrently; the first failure is raised at once (a restarted PS must not wait
        behind a sync pull that another PS holds for a step that will never come), the others' retries end."""
        abandon = threading.Event()
        futures = [self._pool.submit(self._invoke, *job, abandon) for job in jobs]
        done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        failed = [f.exception() for f in futures if f in done and f.exception() is not None]
        if failed:
            abandon.set()
            raise next((e for e in failed if isinstance(e, PSRolledBack)), failed[0])
        return [f.result() for f in futures]

    def wait_ready(self, timeout_s: float | None = None) -> None:
        timeout_s = self.deadline_s if timeout_s is None else timeout_s
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
        for ps, (header, _) in enumerate(self._fan_out(jobs)):
            self._expect(ps, header)

    def _expect(self, ps: int, header: dict) -> None:
        if "incarnation" in header:
            self.expect[ps] = [header["incarnation"], header["generation"]]

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

    def restore(self, state: dict, step: int | None = None) -> None:
        """Load a snapshot into every PS (each keeps its shard: any PS count works). `step`: the
        checkpoint's (sync pulls then wait for the steps after it; other workers find it by Health)."""
        header = {"restore_id": uuid.uuid4().hex, **({} if step is None else {"step": step})}
        for ps, (reply, _) in enumerate(self._fan_out([("Load", ps, header, state) for ps in range(self.num_ps)])):
            self._expect(ps, reply)
        self.restore_id = header["restore_id"]

    restore_id = None  # the last restore this client made or waited for

    def wait_restored(self, timeout_s: float) -> int | None:
        """Block until every PS has taken the same checkpoint restore, one this client has not seen yet
        (non-chief workers, after the chief's); returns that checkpoint's step (None: not given)."""
        deadline = time.monotonic() + timeout_s
        while True:
            health = [h for h, _ in self._fan_out([("Health", ps, {}, {}) for ps in range(self.num_ps)])]
            ids = {h.get("restore_id") for h in health}
            if len(ids) == 1 and None not in ids and self.restore_id not in ids:
                for ps, h in enumerate(health):
                    self._expect(ps, h)
                self.restore_id = ids.pop()
                return health[0].get("restored_step")
            if time.monotonic() > deadline:
                raise PSError(f"the PSs were not restored from a checkpoint within {timeout_s:.0f}s (restores "
                              f"seen: {[h.get('restore_id') for h in health]}; waiting for the chief's)")
            time.sleep(0.2)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for channel in self.channels:
            channel.close()
