"""A parameter-server shard over gRPC (StarServer's PS side).

    gRPC threads (NETWORK_PS_CORE_NUMBER): decode + validate a request
        ──> the shard thread (one per PS: the only code that touches the
            variables, so the hot path takes no lock) ──> encode the reply

The shard owns the keys `key % 1000 % num_shards == shard_index` of every
embedding variable and the dense variables assigned to it. Requests and replies
are `deeprec.distributed.wire` messages; a malformed one gets INVALID_ARGUMENT
with the reason, never a crash.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import sys
import threading
import time

import grpc
import torch

from deeprec.distributed import security
from deeprec.distributed.tuning import core_number, pin_cores, pin_current_thread
from deeprec.distributed.wire import WireError, pack, unpack
from deeprec.errors import ConfigError
from deeprec.nn.variable import EmbeddingVariable, shard_of
from deeprec.optim import sparse
from deeprec.optim.sparse import merge_rows

MAX_DIM = 8192  # embedding dim a Register may ask for
MAX_WAIT_S = 120.0  # longest a sync pull waits for the previous step, whatever its deadline
SERVICE = "deeprec.PS"
log = logging.getLogger("deeprec.ps")
METHODS = ("Register", "Pull", "Push", "PushPull", "Export", "Load", "Health")
MAX_MESSAGE = 1 << 30  # gRPC's default cap is 4 MB: a batch-4096 pull is larger
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]


def make_optimizer(name: str, lr: float) -> sparse.RowSparseOptimizer:
    if name not in sparse.ROW_SPARSE:
        raise WireError(f"optimizer {name!r} is not one of {', '.join(sparse.ROW_SPARSE)}")
    try:
        return sparse.ROW_SPARSE[name](lr=lr)
    except (ConfigError, ValueError) as err:  # a bad request, not a PS failure
        raise WireError(f"optimizer {name!r}: {err}") from None


class ResourceExhausted(WireError):
    """A request that would take the shard past its limits: RESOURCE_EXHAUSTED, nothing changed."""


def _memory_budget() -> int:
    """Default memory budget: 80% of this machine's RAM."""
    try:
        return int(0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def _spec_field(spec: dict, key: str, kind, default=None, low=None, high=None):
    """A Register spec's field, type- and range-checked (WireError naming it)."""
    value = spec.get(key, default)
    name = spec.get("name", "?")
    try:
        if kind is int and (isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value)):
            raise ValueError
        value = kind(value)
    except (TypeError, ValueError, OverflowError):
        raise WireError(f"variable {name!r}: {key!r} must be {kind.__name__}, got {value!r}") from None
    if kind is float and value != value:  # NaN
        raise WireError(f"variable {name!r}: {key!r} must be a number, got NaN")
    if (low is not None and value < low) or (high is not None and value > high):
        raise WireError(f"variable {name!r}: {key!r} must be in [{low}, {high}], got {value!r}")
    return value


class _Dense:
    def __init__(self, value: torch.Tensor, optimizer: sparse.RowSparseOptimizer):
        self.value = value.reshape(value.shape[0], -1).clone() if value.dim() else value.reshape(1, 1).clone()
        self.shape = list(value.shape)
        self.optimizer = optimizer
        specs = dict(optimizer.slots)
        self.slots = {n: torch.full_like(self.value, v) for n, v in specs.items()}
        self.slots.update({n: torch.full((self.value.shape[0],), v) for n, v in optimizer.row_slots.items()})
        self.rows = torch.arange(self.value.shape[0])


class ShardState:
    """The variables of one shard; called only from the shard thread."""

    def __init__(self, shard_index: int, num_shards: int, max_memory: int | None = None, max_dim: int = MAX_DIM):
        self.shard_index, self.num_shards = shard_index, num_shards
        self.max_memory = _memory_budget() if max_memory is None else max_memory
        self.max_dim = max_dim
        self.embeddings: dict[str, tuple[EmbeddingVariable, sparse.RowSparseOptimizer]] = {}
        self.dense: dict[str, _Dense] = {}
        self.generation = 0  # how many checkpoint restores this shard has taken
        self.applied_step = 0  # last step whose (sync: averaged) update is applied
        self._sync: dict[int, dict] = {}

    def _names(self) -> str:
        return ", ".join(sorted([*self.embeddings, *self.dense])) or "none"

    def memory(self) -> int:
        """Bytes the shard's variables hold (rows allocated, with their slots and index)."""
        total = sum(ev.capacity * ev.bytes_per_row() + ev._defaults.numel() * 4 for ev, _ in self.embeddings.values())
        return int(total + sum(d.value.numel() * 4 * (1 + len(d.slots)) for d in self.dense.values()))

    def _reserve(self, nbytes: int, what: str) -> None:
        held = self.memory()
        if held + nbytes > self.max_memory:
            raise ResourceExhausted(f"{what} needs {nbytes:,} bytes; the shard holds {held:,} of its "
                                    f"{self.max_memory:,}-byte budget (--max-memory)")

    def register(self, header: dict, tensors: dict) -> tuple[dict, dict]:
        variables = header.get("variables", [])
        if not isinstance(variables, list) or not all(isinstance(s, dict) for s in variables):
            raise WireError("header 'variables' must be a list of objects")
        for spec in variables:  # validate every spec and the memory they need before creating any
            if not isinstance(spec.get("name"), str) or not spec["name"]:
                raise WireError(f"a variable needs a non-empty string name, got {spec.get('name')!r}")
            _spec_field(spec, "lr", float, 0.01, low=0.0)
            if not isinstance(spec.get("optimizer", "adagrad"), str):
                raise WireError(f"variable {spec['name']!r}: 'optimizer' must be a string")
            if spec.get("kind") == "embedding":
                _spec_field(spec, "dim", int, None, low=1, high=self.max_dim)
        needed = sum(4 * 4096 * int(s["dim"]) for s in variables if s.get("kind") == "embedding"
                     and s["name"] not in self.embeddings)
        needed += sum(3 * 4 * tensors[f"init/{s['name']}"].numel() for s in variables if s.get("kind") == "dense"
                      and s["name"] not in self.dense and f"init/{s['name']}" in tensors)
        self._reserve(needed, f"registering {len(variables)} variable(s)")
        for spec in variables:
            name, kind = spec.get("name"), spec.get("kind")
            optimizer = make_optimizer(spec.get("optimizer", "adagrad"), float(spec.get("lr", 0.01)))
            if kind == "embedding":
                if name not in self.embeddings:
                    ev = EmbeddingVariable(int(spec["dim"]), shard_index=self.shard_index, num_shards=self.num_shards,
                                           name=name)
                    ev.attach_slots({n: (v, True) for n, v in optimizer.slots.items()}
                                    | {n: (v, False) for n, v in optimizer.row_slots.items()})
                    defaults = tensors.get(f"defaults/{name}")  # the worker's initializer matrix
                    if defaults is not None:
                        if defaults.dim() != 2 or defaults.shape[1] != ev.embedding_dim:
                            raise WireError(f"variable {name!r}: defaults must be [n, {ev.embedding_dim}]")
                        ev._defaults = defaults.float().clone()
                    self.embeddings[name] = (ev, optimizer)
            elif kind == "dense":
                if name not in self.dense:
                    if f"init/{name}" not in tensors:
                        raise WireError(f"dense variable {name!r} registered without its initial value")
                    self.dense[name] = _Dense(tensors[f"init/{name}"].float(), optimizer)
            else:
                raise WireError(f"variable {name!r}: kind must be 'embedding' or 'dense', got {kind!r}")
        return {"variables": sorted([*self.embeddings, *self.dense])}, {}

    def _keys(self, name: str, tensors: dict, prefix: str) -> torch.Tensor:
        keys = tensors.get(f"{prefix}keys/{name}")
        if keys is None or keys.dtype != torch.int64 or keys.dim() != 1:
            raise WireError(f"variable {name!r}: '{prefix}keys/{name}' must be a 1-D int64 tensor")
        if keys.numel() and bool((keys < 0).any()):
            raise WireError(f"variable {name!r}: keys must be >= 0")
        wrong = shard_of(keys, self.num_shards) != self.shard_index
        if bool(wrong.any()):
            key = int(keys[wrong][0])
            raise WireError(f"variable {name!r}: key {key} belongs to PS {int(shard_of(keys[wrong][:1], self.num_shards))}"
                            f", not PS {self.shard_index}")
        return keys

    def pull(self, names: list, tensors: dict, prefix: str = "", train: bool = True) -> dict:
        """Rows of the keys (training inserts unseen keys; evaluation reads defaults).
        Every name and key set is checked, and the memory budget once, before any insert."""
        wanted = []
        for name in names:
            if name in self.embeddings:
                wanted.append((name, self._keys(name, tensors, prefix)))
            elif name in self.dense:
                wanted.append((name, None))
            else:
                raise WireError(f"unknown variable {name!r} (this PS holds: {self._names()})")
        if train:
            growth = sum(keys.numel() * self.embeddings[name][0].bytes_per_row() for name, keys in wanted
                         if keys is not None)
            self._reserve(int(growth), f"inserting up to {sum(k.numel() for _, k in wanted if k is not None)} keys")
        out = {}
        for name, keys in wanted:
            if keys is None:
                d = self.dense[name]
                out[f"values/{name}"] = d.value.reshape(d.shape)
            else:
                ev, _ = self.embeddings[name]
                out[f"values/{name}"] = ev.gather(ev.rows_for(keys, train=train))
        return out

    def push(self, names: list, tensors: dict, prefix: str = "", step: int | None = None, workers: int = 1) -> None:
        """Apply gradients now (async), or, with `workers` > 1, collect step `step`'s
        pushes and apply their average once every worker's has arrived (sync)."""
        checked = []
        for name in names:  # validate everything before changing anything
            grad = tensors.get(f"{prefix}grads/{name}")
            if grad is None or grad.dtype != torch.float32:
                raise WireError(f"variable {name!r}: '{prefix}grads/{name}' must be a float32 tensor")
            if name in self.embeddings:
                ev, _ = self.embeddings[name]
                keys = self._keys(name, tensors, prefix)
                if list(grad.shape) != [keys.numel(), ev.embedding_dim]:
                    raise WireError(f"variable {name!r}: grads shape {list(grad.shape)} is not "
                                    f"[{keys.numel()}, {ev.embedding_dim}] for its keys")
                if keys.numel() != torch.unique(keys).numel():  # a key given twice: its gradients summed
                    keys, grad = merge_rows(keys, grad)
                checked.append((name, keys, grad))
            elif name in self.dense:
                if list(grad.shape) != self.dense[name].shape:
                    raise WireError(f"variable {name!r}: grad shape {list(grad.shape)} is not {self.dense[name].shape}")
                checked.append((name, None, grad))
            else:
                raise WireError(f"unknown variable {name!r} (this PS holds: {self._names()})")
        if workers > 1 and step is not None:
            self._drop_stale_sync()
            pending = self._sync.setdefault(step, {"count": 0, "grads": {}, "since": time.monotonic()})
            for name, keys, grad in checked:
                pending["grads"].setdefault(name, []).append((keys, grad))
            pending["count"] += 1
            if pending["count"] < workers:
                return
            del self._sync[step]
            checked = []
            for name, parts in pending["grads"].items():
                if parts[0][0] is None:
                    checked.append((name, None, sum(g for _, g in parts) / workers))
                else:
                    keys, grad = merge_rows(torch.cat([k for k, _ in parts]), torch.cat([g for _, g in parts]))
                    checked.append((name, keys, grad / workers))
        self._apply(checked)
        if step is not None:
            self.applied_step = max(self.applied_step, step)

    def _drop_stale_sync(self) -> None:
        """Sync pushes of a step that never completed (a worker died) are dropped after MAX_WAIT_S."""
        now = time.monotonic()
        for step in [s for s, p in self._sync.items() if now - p["since"] > MAX_WAIT_S]:
            pending = self._sync.pop(step)
            log.warning("PS %d: dropped %d sync push(es) of step %d: the other workers' pushes did not arrive "
                        "within %.0fs", self.shard_index, pending["count"], step, MAX_WAIT_S)

    def _apply(self, checked: list) -> None:
        for name, keys, grad in checked:
            if keys is not None:
                ev, opt = self.embeddings[name]
                opt.begin_step()
                ev.global_step = opt.step_count
                ev.apply_update(opt, ev.rows_for(keys, train=False), grad)
            else:
                d = self.dense[name]
                d.optimizer.begin_step()
                d.optimizer.update(d.value, d.slots, d.rows, grad.reshape(d.value.shape))

    def export(self) -> dict:
        """Every row with its slots, and each optimizer's step count (taken on the shard
        thread, so a row and its slots are always from the same update)."""
        out = {}
        for name, (ev, opt) in self.embeddings.items():
            for key, value in ev.export().items():
                out[f"emb/{name}/{key}"] = value
            out[f"opt/{name}"] = torch.tensor(opt.step_count)
        for name, d in self.dense.items():
            out[f"dense/{name}"] = d.value.reshape(d.shape)
            out.update({f"dense_slot/{name}/{k}": v for k, v in d.slots.items()})
            out[f"opt/{name}"] = torch.tensor(d.optimizer.step_count)
        return out

    def _check_load(self, tensors: dict) -> None:
        """Everything a Load needs, checked before anything changes (a Load is atomic)."""
        for name, (ev, _) in self.embeddings.items():
            prefix = f"emb/{name}/"
            if not any(k.startswith(prefix) for k in tensors):
                continue
            need = ["keys", "values", "freq", "version", "global_step"] + [f"slot.{s}" for s in ev.slots]
            missing = [k for k in need if prefix + k not in tensors] + \
                      ([f"opt/{name}"] if f"opt/{name}" not in tensors else [])
            if missing:
                raise WireError(f"Load of {name!r} lacks {', '.join(missing)}: nothing was changed")
            keys = tensors[prefix + "keys"]
            n = keys.shape[0] if keys.dim() == 1 else -1
            if keys.dtype != torch.int64 or n < 0:
                raise WireError(f"Load of {name!r}: keys must be a 1-D int64 tensor")
            shapes = {"values": [n, ev.embedding_dim], "freq": [n], "version": [n]}
            shapes.update({f"slot.{s}": [n, *slot.shape[1:]] for s, slot in ev.slots.items()})
            for key, shape in shapes.items():
                if list(tensors[prefix + key].shape) != shape:
                    raise WireError(f"Load of {name!r}: {key} has shape {list(tensors[prefix + key].shape)}, "
                                    f"expected {shape}: nothing was changed")
        for name, d in self.dense.items():
            if f"dense/{name}" not in tensors:
                continue
            need = [f"dense/{name}", f"opt/{name}"] + [f"dense_slot/{name}/{k}" for k in d.slots]
            missing = [k for k in need if k not in tensors]
            if missing:
                raise WireError(f"Load of {name!r} lacks {', '.join(missing)}: nothing was changed")
            if tensors[f"dense/{name}"].numel() != d.value.numel() or any(
                    tensors[f"dense_slot/{name}/{k}"].shape != d.slots[k].shape for k in d.slots):
                raise WireError(f"Load of {name!r}: shapes differ from the registered variable: nothing was changed")

    def load(self, tensors: dict) -> None:
        """Restore from a (merged) export: each shard keeps its own keys, whatever the
        number of PSs that wrote it. Validated whole first: a bad Load changes nothing."""
        self._check_load(tensors)
        for name, (ev, opt) in self.embeddings.items():
            prefix = f"emb/{name}/"
            state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            if state:
                ev.load(state)
                opt.step_count = int(tensors[f"opt/{name}"])
        for name, d in self.dense.items():
            if f"dense/{name}" in tensors:
                d.value.copy_(tensors[f"dense/{name}"].reshape(d.value.shape))
                for k in d.slots:
                    d.slots[k].copy_(tensors[f"dense_slot/{name}/{k}"])
                d.optimizer.step_count = int(tensors[f"opt/{name}"])
        self.generation += 1


class PSServicer:
    """gRPC handlers: decode and validate on gRPC threads, run on the shard thread."""

    def __init__(self, state: ShardState, cores: set[int] | None = None, threads: int = 8):
        self.state = state
        self.shard = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deeprec-ps-shard",
                                                           initializer=pin_current_thread, initargs=(cores,))
        self.applied = threading.Condition()
        # sync pulls wait on gRPC threads: at most half of them, so other calls (Health) are always served
        self.waiters = threading.BoundedSemaphore(max(1, threads // 2))

    def _wait_applied(self, after, context) -> None:
        """Sync: a pull of step t waits (bounded) for step t-1's update, on this gRPC thread."""
        after = _int_field({"after_step": after}, "after_step", 0, low=0)
        if not self.waiters.acquire(blocking=False):
            raise ResourceExhausted(f"more than {self.waiters._initial_value} calls already wait for a step")
        try:
            remaining = context.time_remaining()
            timeout = MAX_WAIT_S if remaining is None else min(remaining, MAX_WAIT_S)
            with self.applied:
                if not self.applied.wait_for(lambda: self.state.applied_step >= after, timeout=timeout):
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"PS {self.state.shard_index}: step {after} was not applied within "
                                  f"{timeout:.0f}s (a sync worker is missing?)")
        finally:
            self.waiters.release()

    def _call(self, method: str, request: bytes, context) -> bytes:
        try:
            header, tensors = unpack(request)
            if method == "Health":  # answered here, never queued behind the shard thread
                s = self.state
                return pack({"shard": s.shard_index, "generation": s.generation, "applied_step": s.applied_step}, {})
            if header.get("after_step") is not None:
                self._wait_applied(header["after_step"], context)
            reply_header, reply_tensors = self.shard.submit(self._run, method, header, tensors).result()
            if method in ("Push", "PushPull"):
                with self.applied:
                    self.applied.notify_all()
            return pack(reply_header, reply_tensors)
        except ResourceExhausted as err:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"PS {self.state.shard_index}: {err}")
        except WireError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"PS {self.state.shard_index}: {err}")

    def _run(self, method: str, header: dict, tensors: dict):
        s = self.state
        if method == "Register":
            return s.register(header, tensors)
        if method == "Pull":
            return {}, s.pull(_names(header, "vars"), tensors, train=bool(header.get("train", True)))
        if method == "Push":
            step = None if header.get("step") is None else _int_field(header, "step", 0, low=0)
            s.push(_names(header, "vars"), tensors, step=step, workers=_int_field(header, "workers", 1, low=1,
                                                                                   high=1 << 16))
            return {}, {}
        if method == "PushPull":  # star_server_lite: step t's push and step t+1's pull
            s.push(_names(header, "push"), tensors, "push.")
            return {}, s.pull(_names(header, "pull"), tensors, "pull.")
        if method == "Export":
            return {"shard": s.shard_index, "num_shards": s.num_shards}, s.export()
        if method == "Load":
            s.load(tensors)
            return {"generation": s.generation}, {}
        return {"shard": s.shard_index, "generation": s.generation,
                "variables": sorted([*s.embeddings, *s.dense])}, {}

    def handler(self) -> grpc.GenericRpcHandler:
        methods = {m: grpc.unary_unary_rpc_method_handler(lambda req, ctx, m=m: self._call(m, req, ctx))
                   for m in METHODS}
        return grpc.method_handlers_generic_handler(SERVICE, methods)


def _int_field(header: dict, key: str, default: int, low: int | None = None, high: int | None = None) -> int:
    value = header.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low) \
            or (high is not None and value > high):
        raise WireError(f"header {key!r} must be an int in [{low}, {high}], got {value!r}")
    return value


def _names(header: dict, key: str) -> list:
    names = header.get(key, [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise WireError(f"header '{key}' must be a list of variable names")
    return names


def serve(bind: str, shard_index: int, num_shards: int, threads: int | None = None,
          connections: int = 8, max_memory: int | None = None, max_dim: int = MAX_DIM, token: str | None = None,
          credentials=None, insecure: bool = False) -> tuple[grpc.Server, int]:
    """Start a PS shard listening on `bind` ("host:port", port 0 = any); returns (server, port).
    `threads`: gRPC handler threads (default NETWORK_PS_CORE_NUMBER, else min(8, connections)).
    `token`: every call must carry it (deeprec.distributed.security); a non-loopback `bind`
    without one is refused unless `insecure`. `credentials`: gRPC SSL server credentials."""
    if not token and not insecure and not security.is_loopback(bind):
        raise ConfigError(f"the PS would listen on {bind} with no token: anyone who reaches it could read and "
                          f"change the model. Set {security.TOKEN_ENV} (or --token-file), or pass --insecure")
    threads = threads or core_number("NETWORK_PS_CORE_NUMBER", connections, 8)
    cores = pin_cores("PS", threads, shard_index)  # PS_DISABLE_PIN_CORES=False
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="deeprec-ps-grpc",
                                                 initializer=pin_current_thread, initargs=(cores,))
    interceptors = (security.TokenInterceptor(token),) if token else ()
    server = grpc.server(pool, options=GRPC_OPTIONS, interceptors=interceptors)
    state = ShardState(shard_index, num_shards, max_memory=max_memory, max_dim=max_dim)
    server.add_generic_rpc_handlers((PSServicer(state, cores, threads).handler(),))
    port = server.add_secure_port(bind, credentials) if credentials is not None else server.add_insecure_port(bind)
    if port == 0:
        raise OSError(f"cannot bind the PS to {bind}")
    server.start()
    return server, port


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="run one parameter-server shard")
    parser.add_argument("--bind", help="host:port to listen on (default: loopback, on TF_CONFIG's port for this "
                                       "task, else any free port)")
    parser.add_argument("--token-file", help=f"the job's token (default: ${security.TOKEN_ENV})")
    parser.add_argument("--insecure", action="store_true", help="allow a non-loopback --bind without a token")
    parser.add_argument("--tls-cert", help="PEM certificate chain: serve over TLS")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", help="PEM CA: require client certificates signed by it")
    parser.add_argument("--shard", type=int, help="default: TF_CONFIG's task index, else 0")
    parser.add_argument("--num-shards", type=int, help="default: TF_CONFIG's number of ps tasks, else 1")
    parser.add_argument("--threads", type=int, help="default: NETWORK_PS_CORE_NUMBER, else min(8, workers)")
    parser.add_argument("--workers", type=int, help="workers that will connect (default: TF_CONFIG's, else 8)")
    parser.add_argument("--max-memory", type=int, metavar="BYTES",
                        help="memory budget of the shard's variables (default: 80%% of RAM); past it, "
                             "Register and inserting pulls get RESOURCE_EXHAUSTED")
    parser.add_argument("--max-dim", type=int, default=MAX_DIM, help="largest embedding dim a Register may ask for")
    args = parser.parse_args(argv)
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
    server, port = serve(args.bind, args.shard, args.num_shards, args.threads, connections=args.workers or 8,
                         max_memory=args.max_memory, max_dim=args.max_dim, token=security.read_token(args.token_file),
                         credentials=security.server_credentials(args.tls_cert, args.tls_key, args.tls_ca),
                         insecure=args.insecure)
    host = args.bind.rpartition(":")[0]
    print(f"deeprec PS {args.shard}/{args.num_shards} listening on {host}:{port}", flush=True)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
