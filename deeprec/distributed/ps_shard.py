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
import os
import sys
import threading

import grpc
import torch

from deeprec.distributed.tuning import core_number, pin_cores, pin_current_thread
from deeprec.distributed.wire import WireError, pack, unpack
from deeprec.errors import ConfigError
from deeprec.nn.variable import EmbeddingVariable, shard_of
from deeprec.optim import sparse
from deeprec.optim.sparse import merge_rows

SERVICE = "deeprec.PS"
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

    def __init__(self, shard_index: int, num_shards: int):
        self.shard_index, self.num_shards = shard_index, num_shards
        self.embeddings: dict[str, tuple[EmbeddingVariable, sparse.RowSparseOptimizer]] = {}
        self.dense: dict[str, _Dense] = {}
        self.generation = 0  # how many checkpoint restores this shard has taken
        self.applied_step = 0  # last step whose (sync: averaged) update is applied
        self._sync: dict[int, dict] = {}

    def _names(self) -> str:
        return ", ".join(sorted([*self.embeddings, *self.dense])) or "none"

    def register(self, header: dict, tensors: dict) -> tuple[dict, dict]:
        for spec in header.get("variables", []):
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
        """Rows of the keys (training inserts unseen keys; evaluation reads defaults)."""
        out = {}
        for name in names:
            if name in self.embeddings:
                ev, _ = self.embeddings[name]
                keys = self._keys(name, tensors, prefix)
                out[f"values/{name}"] = ev.gather(ev.rows_for(keys, train=train))
            elif name in self.dense:
                d = self.dense[name]
                out[f"values/{name}"] = d.value.reshape(d.shape)
            else:
                raise WireError(f"unknown variable {name!r} (this PS holds: {self._names()})")
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
                if keys.numel() != torch.unique(keys).numel():
                    raise WireError(f"variable {name!r}: pushed keys must be unique")
                checked.append((name, keys, grad))
            elif name in self.dense:
                if list(grad.shape) != self.dense[name].shape:
                    raise WireError(f"variable {name!r}: grad shape {list(grad.shape)} is not {self.dense[name].shape}")
                checked.append((name, None, grad))
            else:
                raise WireError(f"unknown variable {name!r} (this PS holds: {self._names()})")
        if workers > 1 and step is not None:
            pending = self._sync.setdefault(step, {"count": 0, "grads": {}})
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

    def load(self, tensors: dict) -> None:
        """Restore from a (merged) export: each shard keeps its own keys, whatever the
        number of PSs that wrote it."""
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

    def __init__(self, state: ShardState, cores: set[int] | None = None):
        self.state = state
        self.shard = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deeprec-ps-shard",
                                                           initializer=pin_current_thread, initargs=(cores,))
        self.applied = threading.Condition()

    def _call(self, method: str, request: bytes, context) -> bytes:
        try:
            header, tensors = unpack(request)
            after = header.get("after_step")
            if after is not None:  # sync: a pull of step t waits for step t-1's update (on this gRPC thread)
                with self.applied:
                    if not self.applied.wait_for(lambda: self.state.applied_step >= int(after),
                                                 timeout=context.time_remaining()):
                        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"PS {self.state.shard_index}: step {after} was not applied in time "
                                      "(a sync worker is missing?)")
            reply_header, reply_tensors = self.shard.submit(self._run, method, header, tensors).result()
            if method in ("Push", "PushPull"):
                with self.applied:
                    self.applied.notify_all()
            return pack(reply_header, reply_tensors)
        except WireError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"PS {self.state.shard_index}: {err}")

    def _run(self, method: str, header: dict, tensors: dict):
        s = self.state
        if method == "Register":
            return s.register(header, tensors)
        if method == "Pull":
            return {}, s.pull(_names(header, "vars"), tensors, train=bool(header.get("train", True)))
        if method == "Push":
            s.push(_names(header, "vars"), tensors, step=header.get("step"), workers=int(header.get("workers", 1)))
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


def _names(header: dict, key: str) -> list:
    names = header.get(key, [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise WireError(f"header '{key}' must be a list of variable names")
    return names


def serve(bind: str, shard_index: int, num_shards: int, threads: int | None = None,
          connections: int = 8) -> tuple[grpc.Server, int]:
    """Start a PS shard listening on `bind` ("host:port", port 0 = any); returns (server, port).
    `threads`: gRPC handler threads (default NETWORK_PS_CORE_NUMBER, else min(8, connections))."""
    threads = threads or core_number("NETWORK_PS_CORE_NUMBER", connections, 8)
    cores = pin_cores("PS", threads, shard_index)  # PS_DISABLE_PIN_CORES=False
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="deeprec-ps-grpc",
                                                 initializer=pin_current_thread, initargs=(cores,))
    server = grpc.server(pool, options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((PSServicer(ShardState(shard_index, num_shards), cores).handler(),))
    port = server.add_insecure_port(bind)
    if port == 0:
        raise OSError(f"cannot bind the PS to {bind}")
    server.start()
    return server, port


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="run one parameter-server shard")
    parser.add_argument("--bind", default="127.0.0.1:0")
    parser.add_argument("--shard", type=int, help="default: TF_CONFIG's task index, else 0")
    parser.add_argument("--num-shards", type=int, help="default: TF_CONFIG's number of ps tasks, else 1")
    parser.add_argument("--threads", type=int, help="default: NETWORK_PS_CORE_NUMBER, else min(8, workers)")
    parser.add_argument("--workers", type=int, help="workers that will connect (default: TF_CONFIG's, else 8)")
    args = parser.parse_args(argv)
    if args.shard is None or args.num_shards is None:
        from deeprec.distributed.cluster import task_from_env

        try:
            task = task_from_env("ps")
        except ConfigError as err:
            raise SystemExit(f"error: {err}") from None
        if task is not None:
            args.shard = task.shard if args.shard is None else args.shard
            args.num_shards = task.num_shards if args.num_shards is None else args.num_shards
            args.workers = args.workers or task.num_workers or None
    args.shard = 0 if args.shard is None else args.shard
    args.num_shards = 1 if args.num_shards is None else args.num_shards
    torch.set_num_threads(1)
    server, port = serve(args.bind, args.shard, args.num_shards, args.threads, connections=args.workers or 8)
    host = args.bind.rpartition(":")[0]
    print(f"deeprec PS {args.shard}/{args.num_shards} listening on {host}:{port}", flush=True)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
