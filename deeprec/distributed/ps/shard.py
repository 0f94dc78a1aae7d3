"""A parameter-server shard over gRPC (StarServer's PS side).

    gRPC threads (NETWORK_PS_CORE_NUMBER): decode + validate a request
        ──> run it holding the shard's lock (one request at a time touches the
            variables; run in place, with no hand-over to another thread: a
            hand-over costs two thread switches a call) ──> encode the reply

The shard owns the keys `key % 1000 % num_shards == shard_index` of every
embedding variable and the dense variables assigned to it. Requests and replies
are `deeprec.distributed.ps.wire` messages; a malformed one gets INVALID_ARGUMENT
with the reason, never a crash.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import logging
import sys
import tempfile
import threading
import uuid

import grpc
import torch

from deeprec.distributed.ps import security
from deeprec.distributed.ps.pulled import PullNotHeld
from deeprec.security import TOKEN_ENV, is_loopback, read_token
from deeprec.distributed.ps.tuning import core_number, pin_cores, pin_current_thread
from deeprec.distributed.ps.state import (MAX_DIM, MAX_MESSAGE, MAX_REPLY, MAX_WAIT_S, MIN_REPLY,
                                          ResourceExhausted, ShardState, int_field)
from deeprec.distributed.ps.wire import WireError, pack, unpack
from deeprec.errors import ConfigError
from deeprec.nn.disk_rows import check_tier_folder
from deeprec.nn.options import StorageOption
from deeprec.options import add_arguments, build, bytes_flag, given
from deeprec.runtime.memory import tune_malloc

log = logging.getLogger("deeprec.ps")
SERVICE = "deeprec.PS"
METHODS = ("Register", "Pull", "Push", "PushPull", "Export", "Load", "Health")
# MAX_MESSAGE (1 GiB): gRPC's default cap is 4 MB, and a batch-4096 pull is larger. A training Pull's
# reply must fit it; an evaluation Pull's is cut at --max-reply-bytes and the client asks for the rest.
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]
# the workers ping every 2 s (PSClient's keepalive, to notice a dead link): allow it; the PS pings too,
# so the connection of a worker cut off is closed rather than kept for TCP's 15 minutes
SERVER_OPTIONS = GRPC_OPTIONS + [("grpc.keepalive_permit_without_calls", 1),
                                 ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
                                 ("grpc.http2.max_ping_strikes", 0), ("grpc.keepalive_time_ms", 10000),
                                 ("grpc.keepalive_timeout_ms", 5000)]
# replies kept per client for its retries (a request is answered, not run, a second time): the client
# says with each request which of its earlier ones it no longer waits for ("done"), so only the replies
# of calls still in flight are kept; these caps bound what a client that stops saying so can hold
REPLAYS = 4
CLIENTS = 256  # clients whose replies are kept (the least recent forgotten)


class _DeadlineExceeded(Exception):
    """A sync pull's step was not applied in time: DEADLINE_EXCEEDED."""


class _Stale(Exception):
    """The request expects another incarnation or restore of this PS: FAILED_PRECONDITION."""


class _Forgotten(Exception):
    """A retry of a request whose reply is no longer kept: it may have run, so it is not run again: ABORTED."""


class _Kept:
    """One client's replies by seq, and `forgotten`: every seq up to it was answered and its reply dropped."""

    def __init__(self):
        self.replies: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self.forgotten = 0


class PSServicer:
    """gRPC handlers: decode, validate and run on gRPC threads, one request at a time on the variables.

    Exactly-once: a request with (client, seq) is run once; its reply is kept until the client says it
    is done with it (at most the last REPLAYS per client) and a retry of it gets that reply; a retry
    whose reply was dropped is refused (ABORTED), never run twice. `incarnation` (random per process) and the shard's
    restore generation answer every Register / Load / Health; a request whose "expect" differs was
    meant for the PS before a restart or a rollback and is refused (FAILED_PRECONDITION)."""

    def __init__(self, state: ShardState, threads: int = 8):
        self.state = state
        self.incarnation = uuid.uuid4().hex[:12]
        self.restore_id, self.restored_step = None, None
        self.replies: collections.OrderedDict[str, _Kept] = collections.OrderedDict()
        self.lock = threading.Lock()  # the variables: one request at a time
        self.applied = threading.Condition()
        # sync pulls wait on gRPC threads: at most half of them, so other calls (Health) are always served
        self.waiters = threading.BoundedSemaphore(max(1, threads // 2))
        self.waiting = 0  # sync pulls waiting for a step now (Health's "waiting_pulls")

    def _wait_applied(self, after, context) -> None:
        """Sync: a pull of step t waits (bounded) for step t-1's update, on this gRPC thread; a
        restore (rollback) ends the wait too. It gives up just before the caller's deadline, so
        the caller's retry never finds this wait still holding its place."""
        after = int_field({"after_step": after}, "after_step", 0, low=0)
        generation = self.state.generation

        def ready() -> bool:
            return self.state.applied_step >= after or self.state.generation != generation

        # a pull whose step is applied takes no waiting place: the slowest sync worker's pulls never
        # wait, and refusing them while the faster workers wait for that worker's push stalls the step
        if ready():
            return
        if not self.waiters.acquire(blocking=False):
            raise ResourceExhausted(f"more than {self.waiters._initial_value} calls already wait for a step")
        try:
            remaining = context.time_remaining()
            timeout = MAX_WAIT_S if remaining is None else min(remaining - 0.5, MAX_WAIT_S)
            with self.applied:
                self.waiting += 1
                try:
                    if not self.applied.wait_for(ready, timeout=max(0.0, timeout)):
                        raise _DeadlineExceeded(f"step {after} was not applied within {timeout:.0f}s "
                                                "(a sync worker is missing?)")
                finally:
                    self.waiting -= 1
        finally:
            self.waiters.release()

    def _identity(self) -> dict:
        return {"incarnation": self.incarnation, "generation": self.state.generation}

    def _check_expect(self, header: dict) -> None:
        expect = header.get("expect")
        if expect is None:
            return
        if not (isinstance(expect, list) and len(expect) == 2):
            raise WireError(f"header 'expect' must be [incarnation, generation], got {expect!r}")
        if expect[0] != self.incarnation:
            raise _Stale(f"restarted, its rows are gone (incarnation {self.incarnation}; the caller "
                         f"registered with {expect[0]})")
        if expect[1] != self.state.generation:
            raise _Stale(f"rolled back to a checkpoint (restore {self.state.generation}; the caller had seen "
                         f"{expect[1]})")

    def _replay(self, header: dict) -> tuple[str, int, int] | None:
        """(client, seq, done) of a request that changes the shard, checked; None for the others."""
        if header.get("client") is None:
            return None
        client, seq, done = header["client"], header.get("seq"), header.get("done", 0)
        if not isinstance(client, str) or any(isinstance(v, bool) or not isinstance(v, int) for v in (seq, done)):
            raise WireError("header 'client' must be a string, 'seq' and 'done' ints")
        return client, seq, done

    def _replayed(self, key: tuple[str, int, int]) -> bytes | None:
        """The kept reply of a retry, None for a request not seen yet (under the lock)."""
        client, seq, done = key
        kept = self.replies.setdefault(client, _Kept())
        self.replies.move_to_end(client)
        while kept.replies and next(iter(kept.replies)) <= done:  # answered: the client no longer retries them
            kept.replies.popitem(last=False)
        kept.forgotten = max(kept.forgotten, done)
        if seq in kept.replies:
            return kept.replies[seq]
        if seq <= kept.forgotten:
            raise _Forgotten(f"request {seq} of client {client[:8]} may have run already and its reply is no longer "
                             f"kept (the last {REPLAYS} of a client): not run a second time")
        return None

    def _remember(self, key: tuple[str, int, int], reply: bytes) -> None:
        kept = self.replies.setdefault(key[0], _Kept())
        kept.replies[key[1]] = reply
        while len(kept.replies) > REPLAYS:
            kept.forgotten = max(kept.forgotten, kept.replies.popitem(last=False)[0])
        while len(self.replies) > CLIENTS:
            self.replies.popitem(last=False)

    def _call(self, method: str, request: bytes, context) -> bytes:
        try:
            header, tensors = unpack(request)
            if method == "Health":  # answered here, never waits for the shard's lock
                s = self.state
                return pack({"shard": s.shard_index, "applied_step": s.applied_step, "restore_id": self.restore_id,
                             "restored_step": self.restored_step, "waiting_pulls": self.waiting,
                             **self._identity()}, {})
            self._check_expect(header)
            if header.get("after_step") is not None:
                self._wait_applied(header["after_step"], context)
            replay = self._replay(header)
            with self.lock:
                self._check_expect(header)  # a restore may have come while this one waited
                kept = self._replayed(replay) if replay is not None else None
                if kept is not None:
                    return kept  # a retry: answered, not run again
                reply_header, reply_tensors = self._run(method, header, tensors)
                if method in ("Register", "Load"):
                    reply_header = {**reply_header, **self._identity()}
                if method == "Load":
                    self._restored(header)
                reply = pack(reply_header, reply_tensors)
                if replay is not None:
                    self._remember(replay, reply)
            if method in ("Push", "PushPull", "Load"):
                with self.applied:
                    self.applied.notify_all()
            return reply
        except _Stale as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except _Forgotten as err:
            context.abort(grpc.StatusCode.ABORTED, f"PS {self.state.shard_index}: {err}")
        except ResourceExhausted as err:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"PS {self.state.shard_index}: {err}")
        except PullNotHeld as err:  # a keyless push: the client sends it again with its keys
            context.abort(grpc.StatusCode.NOT_FOUND, f"PS {self.state.shard_index}: {err}")
        except WireError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"PS {self.state.shard_index}: {err}")
        except _DeadlineExceeded as err:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"PS {self.state.shard_index}: {err}")
        except MemoryError:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"PS {self.state.shard_index}: {method}: out of memory")
        except Exception as err:  # every bad input is a WireError: anything else is a bug, said as such
            log.exception("PS %d: %s failed", self.state.shard_index, method)
            context.abort(grpc.StatusCode.INTERNAL, f"PS {self.state.shard_index}: a bug in deeprec: {method} "
                                                    f"raised {type(err).__name__}: {err}")

    def _restored(self, header: dict) -> None:
        """A checkpoint restore: the other workers find it by its id (Health); sync steps go on after its step."""
        self.restore_id = header.get("restore_id")
        step = header.get("step")
        if step is not None:
            self.restored_step = int_field(header, "step", 0, low=0)
            self.state.applied_step = self.restored_step
        log.warning("PS %d: restored from a checkpoint (step %s, restore %d)", self.state.shard_index, step,
                    self.state.generation)

    def _run(self, method: str, header: dict, tensors: dict):
        s = self.state
        if method == "Register":
            return s.register(header, tensors)
        if method == "Pull":
            return s.pull_reply(header, tensors)
        if method == "Push":
            s.push(header, tensors)
            return {}, {}
        if method == "PushPull":  # star_server_lite: step t's push and step t+1's pull
            push, pull = _section(header, "push"), _section(header, "pull")
            client = header.get("client")  # the sections' rows: the push takes those of this client's last pull
            plan = s.pull_plan(pull, tensors, "pull.", client=client)  # checked before the push changes anything
            if plan[3]:
                raise ResourceExhausted(f"PushPull: the pull's reply would pass {s.max_reply:,} bytes "
                                        "(--max-reply-bytes): evaluate with Pull, whose reply comes in chunks")
            s.push(push, tensors, "push.", client=client)
            return s.pull_run(plan)
        if method == "Export":
            after = header.get("after_version")
            if after is not None and not (isinstance(after, dict) and all(
                    isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in after.items())):
                raise WireError(f"Export's after_version must map variable names to ints, got {after!r}")
            return {"shard": s.shard_index, "num_shards": s.num_shards}, s.export(after)
        if method == "Load":
            s.load(tensors)
            return {"generation": s.generation}, {}
        return {"shard": s.shard_index, "generation": s.generation, "variables": s.names()}, {}

    def handler(self) -> grpc.GenericRpcHandler:
        methods = {m: grpc.unary_unary_rpc_method_handler(lambda req, ctx, m=m: self._call(m, req, ctx))
                   for m in METHODS}
        return grpc.method_handlers_generic_handler(SERVICE, methods)


def _section(header: dict, key: str) -> dict:
    section = header.get(key, {})
    if not isinstance(section, dict):
        raise WireError(f"header {key!r} must be an object")
    return section


def serve(bind: str, shard_index: int, num_shards: int, threads: int | None = None,
          connections: int = 8, max_memory: int | None = None, max_dim: int = MAX_DIM, token: str | None = None,
          credentials=None, insecure: bool = False, storage: StorageOption | None = None,
          max_reply: int = MAX_REPLY) -> tuple[grpc.Server, int]:
    """Start a PS shard listening on `bind` ("host:port", port 0 = any); returns (server, port).
    `threads`: gRPC handler threads (default NETWORK_PS_CORE_NUMBER, else min(8, connections)).
    `token`: every call must carry it (deeprec.distributed.ps.security); a non-loopback `bind`
    without one is refused unless `insecure`. `credentials`: gRPC SSL server credentials."""
    if not token and not insecure and not is_loopback(bind):
        raise ConfigError(f"the PS would listen on {bind} with no token: anyone who reaches it could read and "
                          f"change the model. Set {TOKEN_ENV} (or --token-file), or pass --insecure")
    threads = threads or core_number("NETWORK_PS_CORE_NUMBER", connections, 8)
    cores = pin_cores("PS", threads, shard_index)  # PS_DISABLE_PIN_CORES=False
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="deeprec-ps-grpc",
                                                 initializer=pin_current_thread, initargs=(cores,))
    interceptors = (security.TokenInterceptor(token),) if token else ()
    server = grpc.server(pool, options=SERVER_OPTIONS, interceptors=interceptors)
    state = ShardState(shard_index, num_shards, max_memory=max_memory, max_dim=max_dim, storage=storage,
                       max_reply=max_reply)
    server.add_generic_rpc_handlers((PSServicer(state, threads).handler(),))
    port = server.add_secure_port(bind, credentials) if credentials is not None else server.add_insecure_port(bind)
    if port == 0:
        raise OSError(f"cannot bind the PS to {bind}")
    server.start()
    return server, port


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="run one parameter-server shard")
    parser.add_argument("--bind", help="host:port to listen on (default: loopback, on TF_CONFIG's port for this "
                                       "task, else any free port)")
    parser.add_argument("--token-file", help=f"the job's token (default: ${TOKEN_ENV})")
    parser.add_argument("--insecure", action="store_true", help="allow a non-loopback --bind without a token")
    parser.add_argument("--tls-cert", help="PEM certificate chain: serve over TLS")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", help="PEM CA: require client certificates signed by it")
    parser.add_argument("--shard", type=int, help="default: TF_CONFIG's task index, else 0")
    parser.add_argument("--num-shards", type=int, help="default: TF_CONFIG's number of ps tasks, else 1")
    parser.add_argument("--threads", type=int, help="default: NETWORK_PS_CORE_NUMBER, else min(8, workers)")
    parser.add_argument("--workers", type=int, help="workers that will connect (default: TF_CONFIG's, else 8)")
    parser.add_argument("--max-memory", type=bytes_flag, metavar="BYTES",
                        help="memory budget of the shard's variables (default: 80%% of RAM); past it, "
                             "Register and inserting pulls get RESOURCE_EXHAUSTED")
    parser.add_argument("--max-dim", type=int, default=MAX_DIM, help="largest embedding dim a Register may ask for")
    parser.add_argument("--max-reply-bytes", type=bytes_flag, default=MAX_REPLY, metavar="BYTES",
                        help=f"largest reply to an evaluation Pull (default {MAX_REPLY >> 20} MiB, at least "
                             f"{MIN_REPLY >> 10} KiB): a larger one is answered in chunks, which the client asks "
                             "for in turn. Keep it under the clients' receive cap (deeprec's: 1 GiB; gRPC's "
                             "default: 4 MB)")
    add_arguments(parser.add_argument_group("storage", "where the shard's embedding rows live"), StorageOption,
                  ("storage",), exclude=("prefetch",))  # the flags of deeprec train's storage section
    parser.add_argument("--no-malloc-tuning", action="store_true",
                        help="keep glibc malloc's defaults (by default the PS keeps freed memory mapped: each "
                             "call's megabyte-sized messages then reuse pages instead of faulting fresh ones in; "
                             "measured 8.7 -> 6.6 ms of PS CPU per step with dense on the PS)")
    args = parser.parse_args(argv)
    if args.max_reply_bytes < MIN_REPLY:
        parser.error(f"--max-reply-bytes must be at least {MIN_REPLY} (a row of --max-dim {MAX_DIM} fits), "
                     f"got {args.max_reply_bytes}")
    try:
        return _run_shard(args)
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None


def _run_shard(args) -> int:
    from deeprec.distributed.cluster import task_from_env

    task = task_from_env("ps")
    if task is not None:
        args.shard = task.shard if args.shard is None else args.shard
        args.num_shards = task.num_shards if args.num_shards is None else args.num_shards
        args.workers = args.workers or task.num_workers or None
        args.bind = args.bind or "127.0.0.1:" + task.address.rpartition(":")[2]  # its cluster port
    args.bind = args.bind or "127.0.0.1:0"
    args.shard = 0 if args.shard is None else args.shard
    args.num_shards = 1 if args.num_shards is None else args.num_shards
    torch.set_num_threads(1)
    storage = build(StorageOption, given(args, StorageOption, ("storage",)))
    if storage.tiered:  # a bad --storage-path fails at start, not at the first Register
        check_tier_folder(storage.path or tempfile.gettempdir())
    if not args.no_malloc_tuning:
        tune_malloc()
    server, port = serve(args.bind, args.shard, args.num_shards, args.threads, connections=args.workers or 8,
                         max_memory=args.max_memory, max_dim=args.max_dim, token=read_token(args.token_file),
                         credentials=security.server_credentials(args.tls_cert, args.tls_key, args.tls_ca),
                         insecure=args.insecure, storage=storage, max_reply=args.max_reply_bytes)
    host = args.bind.rpartition(":")[0]
    print(f"deeprec PS {args.shard}/{args.num_shards} listening on {host}:{port}", flush=True)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
