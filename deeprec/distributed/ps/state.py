"""The variables of one PS shard and the requests on them (one at a time: the servicer holds the shard's lock).

Requests are `deeprec.distributed.ps.wire` messages. Rows travel fused, not per variable:

    Pull   header {"embeddings": [names], "dense": [names], "train": bool}
           tensors keys int64 [N] (variable by variable), counts int64 [len(embeddings)]
      ->   values/{dim} float32 [N_dim, dim] (the rows of the variables of that dim, in
           request order), dense/{name} each dense variable's value
    Push   header {"embeddings", "dense", "step"?, "workers"?}
           tensors keys, counts, grads/{dim} [N_dim, dim], dense/{name} gradients
           or, with "pulled": seq, no keys nor counts: the keys of that training pull of the
           same client (deeprec/distributed/ps/pulled.py)
    PushPull (star_server_lite): header {"push": {...Push}, "pull": {...Pull}},
           tensors prefixed "push." and "pull."

Every field is validated before anything changes; a bad one raises WireError (the
servicer answers INVALID_ARGUMENT), a limit ResourceExhausted (RESOURCE_EXHAUSTED).
"""
from __future__ import annotations

import functools
import logging
import math
import os
import time
from dataclasses import dataclass

import torch

from deeprec.distributed.ps.pulled import PulledRows
from deeprec.distributed.ps.store import DenseGroup, EmbeddingArena, load_bytes, row_bytes
from deeprec.distributed.ps.tiered import TieredArena
from deeprec.distributed.ps.wire import ResourceExhausted, WireError
from deeprec.nn.options import InitializerOption, StorageOption
from deeprec.nn.variable import PARTITION_MOD, shard_of
from deeprec.optim.sparse import row_sparse_optimizer

MAX_DIM = 8192  # embedding dim a Register may ask for
MAX_WAIT_S = 120.0  # longest a sync step's pushes wait for the other workers'
MAX_REPLY = 64 << 20  # default bound of an evaluation Pull's reply (larger ones are answered in chunks)
MIN_REPLY = 64 << 10  # the smallest bound a server may set: a row of MAX_DIM fits twice
MAX_MESSAGE = 1 << 30  # the transport's message cap (shard.GRPC_OPTIONS): a training Pull's reply must fit
_REPLY_SLACK = 16 << 10  # a reply's header and alignment, beyond its tensors' bytes
log = logging.getLogger("deeprec.ps")


@dataclass
class _Part:
    """The keys of one request that live in one arena."""
    arena: EmbeddingArena
    ns: torch.Tensor
    keys: torch.Tensor
    dim: int
    position: torch.Tensor | None  # where its rows go among the request's rows of its dim; None: all of them


make_optimizer = functools.partial(row_sparse_optimizer, error=WireError)  # a bad name or lr: a bad request


class ShardState:
    def __init__(self, shard_index: int, num_shards: int, max_memory: int | None = None, max_dim: int = MAX_DIM,
                 storage: StorageOption | None = None, max_reply: int = MAX_REPLY):
        self.shard_index, self.num_shards = shard_index, num_shards
        self.max_reply = max(MIN_REPLY, max_reply)  # an evaluation Pull's reply, in bytes (then chunked)
        self.storage = storage  # with an ssd tier: each embedding variable's rows in DRAM + disk (TieredArena)
        self.max_memory = _memory_budget() if max_memory is None else max_memory
        self.max_dim = max_dim
        self.arenas: dict[tuple, EmbeddingArena] = {}  # (dim, optimizer, lr) -> arena
        self.groups: dict[tuple, DenseGroup] = {}  # (optimizer, lr) -> dense group
        self.embeddings: dict[str, tuple[EmbeddingArena, int]] = {}  # name -> (arena, variable id)
        self.dense: dict[str, DenseGroup] = {}
        self.generation = 0  # how many checkpoint restores this shard has taken
        self.applied_step = 0  # last step whose (sync: averaged) update is applied
        self._sync: dict[int, dict] = {}
        self._pulled = PulledRows()  # each client's last training pull's rows, for its push

    def names(self) -> list[str]:
        return sorted([*self.embeddings, *self.dense])

    def memory(self) -> int:
        """Bytes the shard's variables hold (rows allocated, with their slots and index)."""
        return sum(a.memory() for a in self.arenas.values()) + sum(g.memory() for g in self.groups.values())

    def _reserve(self, nbytes: int, what: str) -> None:
        held = self.memory()
        if held + nbytes > self.max_memory:
            raise ResourceExhausted(f"{what} needs {nbytes:,} bytes; the shard holds {held:,} of its "
                                    f"{self.max_memory:,}-byte budget (--max-memory)")

    # -- Register --------------------------------------------------------------------------
    def register(self, header: dict, tensors: dict) -> tuple[dict, dict]:
        variables = header.get("variables", [])
        if not isinstance(variables, list) or not all(isinstance(s, dict) for s in variables):
            raise WireError("header 'variables' must be a list of objects")
        new, seen, needed, arenas = [], set(), 0, set()
        for spec in variables:  # validate every spec and the memory they need before creating any
            name, kind = spec.get("name"), spec.get("kind")
            if not isinstance(name, str) or not name:
                raise WireError(f"Register: a variable needs a non-empty string name, got {name!r}")
            if name in seen:
                raise WireError(f"Register: variable {name!r} is given twice")
            seen.add(name)
            lr = _spec_field(spec, "lr", float, 0.01)
            if not (math.isfinite(lr) and lr > 0):
                raise WireError(f"Register: variable {name!r}: lr must be > 0 and finite, got {lr!r} (e.g. 0.01)")
            optimizer = spec.get("optimizer", "adagrad")
            if not isinstance(optimizer, str):
                raise WireError(f"Register: variable {name!r}: 'optimizer' must be a string")
            opt = make_optimizer(optimizer, lr)
            if kind in ("embedding", "dense") and name in (self.dense if kind == "embedding" else self.embeddings):
                raise WireError(f"Register: variable {name!r} is already registered as "
                                f"{'dense' if kind == 'embedding' else 'embedding'}, not {kind}")
            if kind == "embedding":
                dim = _spec_field(spec, "dim", int, None, low=1, high=self.max_dim)
                defaults = tensors.get(f"defaults/{name}")  # the worker's initializer matrix
                if defaults is not None and (defaults.dim() != 2 or defaults.shape[1] != dim or not len(defaults)
                                             or not defaults.is_floating_point()):
                    raise WireError(f"Register: 'defaults/{name}' must be a float [n >= 1, {dim}] tensor, got "
                                    f"{str(defaults.dtype)[6:]} {list(defaults.shape)}")
                if name not in self.embeddings:
                    if defaults is not None:
                        _check_finite(defaults, f"defaults/{name}", "value", "nothing was registered")
                        needed += 4 * defaults.numel()  # held as float32, stacked with the arena's others
                    else:
                        needed += 4 * InitializerOption().default_value_dim * dim
                    key = (dim, optimizer, lr)
                    if key not in self.arenas and key not in arenas:  # a new arena: its first rows and index
                        arenas.add(key)
                        needed += 1024 * (row_bytes(dim, opt) + 32)
                    new.append((name, kind, key, defaults))
            elif kind == "dense":
                init = tensors.get(f"init/{name}")
                if name not in self.dense:
                    if init is None or not init.is_floating_point():
                        raise WireError(f"Register: 'init/{name}' must be the dense variable's float initial value, "
                                        f"got {'nothing' if init is None else str(init.dtype)[6:]}")
                    _check_finite(init, f"init/{name}", "value", "nothing was registered")
                    per_element = sum(1 for _, e in opt.slot_specs().values() if e)
                    needed += 4 * init.numel() * (2 + per_element)  # value and slots, and the copy that grows them
                    new.append((name, kind, (optimizer, lr), init))
            else:
                raise WireError(f"Register: variable {name!r}: 'kind' must be 'embedding' or 'dense', got {kind!r}")
        self._reserve(needed, f"registering {len(new)} variable(s)")
        for name, kind, key, tensor in new:
            if kind == "embedding":
                if key not in self.arenas and self.storage is not None and self.storage.tiered:
                    self.arenas[key] = TieredArena(key[0], make_optimizer(*key[1:]), self.storage, self.shard_index,
                                                   self.num_shards)
                elif key not in self.arenas:
                    self.arenas[key] = EmbeddingArena(key[0], make_optimizer(*key[1:]), reserve_bytes=self.max_memory)
                arena = self.arenas[key]
                if tensor is None:
                    tensor = InitializerOption().matrix(key[0])
                self.embeddings[name] = (arena, arena.add(name, tensor))
            else:
                if key not in self.groups:
                    self.groups[key] = DenseGroup(make_optimizer(*key))
                self.groups[key].add(name, tensor)
                self.dense[name] = self.groups[key]
        return {"variables": self.names()}, {}

    # -- requests ------------------------------------------------------------------------
    def _rows_request(self, header: dict, tensors: dict, prefix: str) -> list[_Part]:
        """The request's keys, validated and split by arena."""
        names = _names(header, "embeddings")
        if not names:
            return []
        keys, counts = tensors.get(prefix + "keys"), tensors.get(prefix + "counts")
        if keys is None or keys.dtype != torch.int64 or keys.dim() != 1:
            raise WireError(f"'{prefix}keys' must be a 1-D int64 tensor")
        if counts is None or counts.dtype != torch.int64 or list(counts.shape) != [len(names)]:
            raise WireError(f"'{prefix}counts' must be an int64 tensor of {len(names)} (one per embedding)")
        held = [self.embeddings.get(n) for n in names]
        # one pass (csrc/ps_rows.cpp): each key's variable id, the counts, keys < 0, keys of other shards
        ns, status = torch.ops.deeprec.ps_request_ns(keys.contiguous(), counts.contiguous(),
                                                     torch.tensor([-1 if h is None else h[1] for h in held]),
                                                     self.num_shards, self.shard_index, PARTITION_MOD)
        fits, negative, wrong = status.tolist()
        if not fits:
            raise WireError(f"'{prefix}counts' must be >= 0 and sum to the {keys.numel()} keys")
        if None in held:
            unknown = names[held.index(None)]
            raise WireError(f"unknown variable {unknown!r} (this PS holds: {', '.join(self.names()) or 'none'})")
        if negative >= 0:
            raise WireError("keys must be >= 0")
        if wrong >= 0:
            var = int(torch.searchsorted(torch.cumsum(counts, 0), torch.tensor([wrong]), right=True))
            raise WireError(f"variable {names[var]!r}: key {int(keys[wrong])} belongs to PS "
                            f"{int(shard_of(keys[wrong:wrong + 1], self.num_shards))}, not PS {self.shard_index}")
        arenas = [arena for arena, _ in held]
        distinct = list(dict.fromkeys(arenas))
        if len(distinct) == 1:
            return [_Part(arenas[0], ns, keys, arenas[0].dim, None)]
        which = torch.repeat_interleave(torch.tensor([distinct.index(a) for a in arenas]), counts)
        key_dim = torch.repeat_interleave(torch.tensor([a.dim for a in arenas]), counts)
        parts = []
        for i, arena in enumerate(distinct):
            sel = torch.nonzero(which == i).squeeze(1)
            shared = sum(a.dim == arena.dim for a in distinct) > 1
            position = (torch.cumsum(key_dim == arena.dim, 0) - 1)[sel] if shared else None
            parts.append(_Part(arena, ns[sel], keys[sel], arena.dim, position))
        return parts

    def _dense_names(self, header: dict) -> list[str]:
        names = _names(header, "dense")
        unknown = [n for n in names if n not in self.dense]
        if unknown:
            raise WireError(f"unknown dense variable {unknown[0]!r} (this PS holds: {', '.join(self.names()) or 'none'})")
        return names

    def pull(self, header: dict, tensors: dict, prefix: str = "") -> dict:
        """Rows of the keys (training inserts unseen keys; evaluation reads zeros for them) and dense
        values; an evaluation pull past `max_reply` answers a prefix of its keys (`pull_reply` says which)."""
        return self.pull_reply(header, tensors, prefix)[1]

    def pull_reply(self, header: dict, tensors: dict, prefix: str = "") -> tuple[dict, dict]:
        """(reply header, `pull`'s tensors): `pull_plan` then `pull_run`."""
        return self.pull_run(self.pull_plan(header, tensors, prefix))

    def pull_plan(self, header: dict, tensors: dict, prefix: str = "", client: str | None = None) -> tuple:
        """A Pull checked whole, the memory budget included, before anything changes. `client`
        (default: the header's): who pulls, whose push of the same keys will reuse the rows found.

        An evaluation pull (train false) whose rows pass `max_reply` bytes is cut to the prefix of its
        keys that fits: the reply's header then says {"rows": m} (of the request's keys, in order), and
        the client asks for the rest (PSClient). A training pull is answered whole (its keys are a batch's)."""
        _check_fields(header, ("embeddings", "dense", "train"), "Pull")
        train = header.get("train", True)
        if not isinstance(train, bool):
            raise WireError(f"Pull: header 'train' must be true or false, got {train!r}")
        parts, dense = self._rows_request(header, tensors, prefix), self._dense_names(header)
        reply = {}
        if parts:
            nbytes = sum(4 * p.keys.numel() * p.dim for p in parts)
            if train:
                if nbytes > MAX_MESSAGE - _REPLY_SLACK:
                    raise ResourceExhausted(f"Pull: a training pull of {sum(p.keys.numel() for p in parts):,} keys "
                                            f"would answer {nbytes:,} bytes, past the {MAX_MESSAGE:,}-byte message "
                                            "cap: split the batch")
                growth = sum(p.keys.numel() * p.arena.bytes_per_row() for p in parts)
                self._reserve(growth, f"Pull: inserting up to {sum(p.keys.numel() for p in parts)} keys")
            elif nbytes + _dense_bytes(self, dense) > self.max_reply - _REPLY_SLACK:
                parts, rows = self._first_rows(header, tensors, prefix, dense)
                reply = {"rows": rows}
        client = header.get("client") if client is None else client
        # the keys stay a view of the request unless it holds more (a PushPull's gradients)
        pulled = (header.get("seq"), header.get("embeddings"), prefix == "")
        return train, parts, dense, reply, client if train and isinstance(client, str) else None, pulled

    def _first_rows(self, header: dict, tensors: dict, prefix: str, dense: list) -> tuple[list, int]:
        """The parts of the longest prefix of the request's keys whose rows fit `max_reply` (at least one key)."""
        names = header["embeddings"]
        keys, counts = tensors[prefix + "keys"], tensors[prefix + "counts"]
        dims = torch.tensor([self.embeddings[n][0].dim for n in names], dtype=torch.int64)
        budget = self.max_reply - _REPLY_SLACK - _dense_bytes(self, dense)
        ends = torch.cumsum(torch.repeat_interleave(4 * dims, counts), 0)  # reply bytes after each key
        rows = max(1, int(torch.searchsorted(ends, torch.tensor([budget]), right=True)))
        last = torch.cumsum(counts, 0)
        cut = torch.clamp(torch.clamp(last, max=rows) - (last - counts), min=0)
        return self._rows_request(header, {prefix + "keys": keys[:rows], prefix + "counts": cut}, prefix), rows

    def pull_run(self, plan: tuple) -> tuple[dict, dict]:
        train, parts, dense, reply, client, (seq, names, view) = plan
        out, found = {}, {}
        for dim in dict.fromkeys(p.dim for p in parts):
            mine = [p for p in parts if p.dim == dim]
            values = torch.empty(sum(p.keys.numel() for p in mine), dim)
            for p in mine:
                rows, repeated = p.arena.rows(p.ns, p.keys, insert=train)
                found[id(p)] = (rows, repeated)
                if p.position is None:
                    p.arena.gather(rows, out=values)
                else:
                    values[p.position] = p.arena.gather(rows)
            out[f"values/{dim}"] = values
        out.update({f"dense/{name}": self.dense[name].view(name) for name in dense})
        if client is not None and parts and all(type(p.arena) is EmbeddingArena for p in parts):
            kept = parts if view else [_Part(p.arena, p.ns, p.keys.clone(), p.dim, p.position) for p in parts]
            self._pulled.remember(client, self.generation, seq, names, kept, [found[id(p)] for p in parts])
            reply = {**reply, "kept": seq}  # the client's push may name this pull instead of its keys
        return reply, out

    def push(self, header: dict, tensors: dict, prefix: str = "", client: str | None = None) -> None:
        """Apply gradients now (async), or, with `workers` > 1, collect step `step`'s
        pushes and apply their average once every worker's has arrived (sync). `client` (default:
        the header's): who pushes; a push of the keys of its last training pull takes their rows."""
        _check_fields(header, ("embeddings", "dense", "step", "workers", "pulled"), "Push")
        step = None if header.get("step") is None else int_field(header, "step", 0, low=0)
        workers = int_field(header, "workers", 1, low=1, high=1 << 16)
        client = header.get("client") if client is None else client
        names = self._dense_names(header)
        if header.get("pulled") is not None:  # keyless: the keys of that pull of this client
            seq = int_field(header, "pulled", 0)
            if f"{prefix}keys" in tensors or f"{prefix}counts" in tensors:
                raise WireError(f"Push: a push that names its pull ('pulled') carries no '{prefix}keys' or "
                                f"'{prefix}counts'")
            parts, found = self._pulled.keyless(client, seq, _names(header, "embeddings"), self.generation)
        else:
            parts = self._rows_request(header, tensors, prefix)
            found = self._pulled.take(client, parts, self.generation)
        found = dict(zip(map(id, parts), found)) if found is not None else {}
        rows_grads = []
        for dim in dict.fromkeys(p.dim for p in parts):  # validate everything before changing anything
            n = sum(p.keys.numel() for p in parts if p.dim == dim)
            grads = tensors.get(f"{prefix}grads/{dim}")
            if grads is None or grads.dtype != torch.float32 or list(grads.shape) != [n, dim]:
                got = "missing" if grads is None else f"{str(grads.dtype)[6:]} {list(grads.shape)}"
                raise WireError(f"'{prefix}grads/{dim}' must be float32 [{n}, {dim}] for its keys, got {got}")
            _check_finite(grads, f"{prefix}grads/{dim}")
            for p in parts:
                if p.dim == dim:
                    rows_grads.append((p, grads if p.position is None else grads[p.position]))
        dense = {}
        for name in names:
            grad = tensors.get(f"{prefix}dense/{name}")
            shape = self.dense[name].spans[name][2]
            if grad is None or grad.dtype != torch.float32 or list(grad.shape) != shape:
                raise WireError(f"'{prefix}dense/{name}' must be a float32 gradient of shape {shape}")
            _check_finite(grad, f"{prefix}dense/{name}")
            dense[name] = grad
        if header.get("pulled") is not None:
            self._pulled.drop(client)  # checked whole: the pull's rows are taken
        # rows are found when applied, unless the pull found them (an EmbeddingArena's rows stay put)
        updates = [(p.arena, p.ns, p.keys, g, found.get(id(p))) for p, g in rows_grads]
        if workers > 1 and step is not None:
            self._drop_stale_sync()
            pending = self._sync.setdefault(step, {"count": 0, "rows": [], "dense": {}, "since": time.monotonic()})
            pending["rows"] += updates
            for name, grad in dense.items():
                pending["dense"].setdefault(name, []).append(grad)
            pending["count"] += 1
            if pending["count"] < workers:
                return
            del self._sync[step]
            # the workers' keys may repeat: _apply merges each arena's parts and sums repeats
            updates = [(arena, ns, keys, grads / workers, rows) for arena, ns, keys, grads, rows in pending["rows"]]
            dense = {name: sum(gs) / workers for name, gs in pending["dense"].items()}
        self._apply(updates, dense)
        if step is not None:
            self.applied_step = max(self.applied_step, step)

    def _apply(self, updates: list, dense: dict) -> None:
        """One optimizer step per arena over its parts (sync: one per worker), rows found now: a
        tiered arena's rows may have moved since the push arrived."""
        for arena in dict.fromkeys(u[0] for u in updates):
            mine = [u[1:] for u in updates if u[0] is arena]
            if len(mine) == 1 and mine[0][3] is not None:  # the rows its pull found
                _, _, grads, (rows, repeated) = mine[0]
                arena.apply(rows, grads, repeated > 0, held=True)  # a training pull's rows: all held
                continue
            ns, keys, grads = mine[0][:3] if len(mine) == 1 else (torch.cat(part) for part in list(zip(*mine))[:3])
            rows, repeated = arena.rows(ns, keys, insert=False)
            arena.apply(rows, grads, repeated > 0)
        for group in dict.fromkeys(self.dense[n] for n in dense):
            group.apply({n: g for n, g in dense.items() if self.dense[n] is group})

    def _drop_stale_sync(self) -> None:
        """Sync pushes of a step that never completed (a worker died) are dropped after MAX_WAIT_S."""
        now = time.monotonic()
        for step in [s for s, p in self._sync.items() if now - p["since"] > MAX_WAIT_S]:
            pending = self._sync.pop(step)
            log.warning("PS %d: dropped %d sync push(es) of step %d: the other workers' pushes did not arrive "
                        "within %.0fs", self.shard_index, pending["count"], step, MAX_WAIT_S)

    # -- checkpoints -----------------------------------------------------------------------
    def export(self, after_version: dict[str, int] | None = None) -> dict:
        """Every row with its slots, and each optimizer's step count; `after_version` {variable: step}:
        only its rows updated after that step of its optimizer on this PS (a serving delta)."""
        out = {}
        for name, (arena, var) in self.embeddings.items():
            rows = arena.export(var)
            if after_version is not None and name in after_version:
                updated = rows["version"] > after_version[name]
                rows = {k: v[updated] if v.dim() > 0 else v for k, v in rows.items()}
            out.update({f"emb/{name}/{k}": v for k, v in rows.items()})
            out[f"opt/{name}"] = torch.tensor(arena.optimizer.step_count)
        for name, group in self.dense.items():
            out.update(group.export(name))
            out[f"opt/{name}"] = torch.tensor(group.optimizer.step_count)
        return out

    def _check_load(self, tensors: dict) -> None:
        """Everything a Load needs, checked before anything changes (a Load is atomic): each field's
        presence, dtype, shape and finiteness, the keys, and the memory the rebuilt arenas will hold."""
        loaded: dict[int, dict[int, int]] = {}  # id(arena) -> {variable id: rows this shard keeps}
        for name, (arena, var) in self.embeddings.items():
            prefix = f"emb/{name}/"
            if not any(k.startswith(prefix) for k in tensors):
                continue
            need = ["keys", "values", "freq", "version", "global_step"] + [f"slot.{s}" for s in arena.slots]
            missing = [prefix + k for k in need if prefix + k not in tensors] + \
                      ([f"opt/{name}"] if f"opt/{name}" not in tensors else [])
            if missing:
                raise WireError(f"Load of {name!r} lacks {', '.join(missing)}: nothing was changed")
            keys = tensors[prefix + "keys"]
            n = keys.shape[0] if keys.dim() == 1 else -1
            if keys.dtype != torch.int64 or n < 0:
                raise WireError(f"Load: '{prefix}keys' must be a 1-D int64 tensor, got {str(keys.dtype)[6:]} "
                                f"{list(keys.shape)}: nothing was changed")
            if n and bool((keys < 0).any()):
                raise WireError(f"Load: '{prefix}keys' must be >= 0: nothing was changed")
            shapes = {"values": [n, arena.dim], "freq": [n], "version": [n]}
            shapes.update({f"slot.{s}": [n, *slot.shape[1:]] for s, slot in arena.slots.items()})
            for key, shape in shapes.items():
                t = tensors[prefix + key]
                floating = key == "values" or key.startswith("slot.")
                if list(t.shape) != shape or t.is_floating_point() != floating or t.dtype == torch.bool:
                    raise WireError(f"Load: '{prefix}{key}' is {str(t.dtype)[6:]} {list(t.shape)}, expected "
                                    f"{'float' if floating else 'int64'} {shape}: nothing was changed")
                if floating:
                    _check_finite(t, prefix + key, "value", "nothing was changed")
            _check_count(tensors, prefix + "global_step")
            _check_count(tensors, f"opt/{name}")
            if torch.unique(keys).numel() != n:
                raise WireError(f"Load: '{prefix}keys' gives a key twice: nothing was changed")
            mine = shard_of(keys, self.num_shards) == self.shard_index if self.num_shards > 1 else None
            loaded.setdefault(id(arena), {})[var] = n if mine is None else int(mine.sum())
        for name, group in self.dense.items():
            if f"dense/{name}" not in tensors:
                continue
            need = [f"dense/{name}", f"opt/{name}"] + [f"dense_slot/{name}/{k}" for k in group.optimizer.slot_specs()]
            missing = [k for k in need if k not in tensors]
            if missing:
                raise WireError(f"Load of {name!r} lacks {', '.join(missing)}: nothing was changed")
            for key in need[:1] + need[2:]:
                t = tensors[key]
                slot = key.rpartition("/")[2]
                numel = group.spans[name][1] if key == need[0] else group.slot_numel(name, slot)
                if t.numel() != numel or not t.is_floating_point():
                    raise WireError(f"Load: '{key}' is {str(t.dtype)[6:]} {list(t.shape)}, expected {numel} float "
                                    f"values (the registered variable's): nothing was changed")
                _check_finite(t, key, "value", "nothing was changed")
            _check_count(tensors, f"opt/{name}")
        growth = 0  # the arenas are rebuilt: what they will hold, less what they hold now
        for arena in self.arenas.values():
            if id(arena) not in loaded or not isinstance(arena, EmbeddingArena):
                continue  # a tiered arena's rows go to its disk tier past its DRAM budget
            counts = loaded[id(arena)]
            rows = sum(counts[v] if v in counts else int((arena.row_ns[:arena.size] == v).sum())
                       for v in range(len(arena.names)))
            after = load_bytes(arena.dim, arena.optimizer, rows, bool(arena.reserve_rows))
            growth += after + 4 * arena._default_matrix.numel() - arena.memory()
        if growth > 0:
            self._reserve(growth, "Load")

    def load(self, tensors: dict) -> None:
        """Restore from a (merged) export: each shard keeps its own keys, whatever the
        number of PSs that wrote it. Validated whole first: a bad Load changes nothing."""
        self._check_load(tensors)
        for arena in self.arenas.values():
            states = {var: {k: tensors[f"emb/{name}/{k}"] for k in ("keys", "values", "freq", "version")}
                      | {f"slot.{s}": tensors[f"emb/{name}/slot.{s}"] for s in arena.slots}
                      for var, name in enumerate(arena.names) if f"emb/{name}/keys" in tensors}
            if states:
                arena.load(states, self.shard_index, self.num_shards)
                arena.optimizer.step_count = max(int(tensors[f"opt/{arena.names[v]}"]) for v in states)
        for name, group in self.dense.items():
            if f"dense/{name}" in tensors:
                group.load(name, tensors)
                group.optimizer.step_count = int(tensors[f"opt/{name}"])
        self._sync.clear()  # rows were renumbered: pending sync pushes no longer apply
        self._pulled.clear()  # and the rows pulls found are no longer theirs
        self.generation += 1


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
        raise WireError(f"Register: variable {name!r}: {key!r} must be {kind.__name__}, got {value!r}") from None
    if kind is float and value != value:  # NaN
        raise WireError(f"Register: variable {name!r}: {key!r} must be a finite number, got NaN")
    if (low is not None and value < low) or (high is not None and value > high):
        raise WireError(f"Register: variable {name!r}: {key!r} must be in [{low}, {high}], got {value!r}")
    return value


def int_field(header: dict, key: str, default: int, low: int | None = None, high: int | None = None) -> int:
    value = header.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low) \
            or (high is not None and value > high):
        raise WireError(f"header {key!r} must be an int in [{low}, {high}], got {value!r}")
    return value


def _check_finite(grad: torch.Tensor, name: str, what: str = "gradient",
                  outcome: str = "nothing of this push was applied") -> None:
    """A non-finite gradient (or Load value, initializer) would turn the rows it touches to nan for every worker."""
    bad = torch.ops.deeprec.ps_finite_prefix(grad)  # one vectorized pass over the bits (csrc/ps_rows.cpp)
    if bad < grad.numel():
        raise WireError(f"'{name}' holds a non-finite {what} ({float(grad.reshape(-1)[bad])} at element {bad}): "
                        f"{outcome}")


def _dense_bytes(state: ShardState, names: list) -> int:
    return sum(4 * state.dense[n].spans[n][1] for n in names)


def _check_count(tensors: dict, key: str) -> int:
    """A Load's optimizer step count or global step: one integer >= 0."""
    t = tensors[key]
    if t.numel() != 1 or t.is_floating_point() or t.dtype == torch.bool or int(t.reshape(-1)[0]) < 0:
        raise WireError(f"Load: '{key}' must be one int64 >= 0, got {str(t.dtype)[6:]} {list(t.shape)}: "
                        "nothing was changed")
    return int(t.reshape(-1)[0])


def _check_fields(header: dict, allowed: tuple, method: str) -> None:
    transport = {"tensors", "after_step", "client", "seq", "done", "expect"}  # PSClient's, not the method's
    unknown = sorted(set(header) - set(allowed) - transport)
    if unknown:
        raise WireError(f"{method}: unknown header field {unknown[0]!r} (allowed: {', '.join(allowed)})")


def _names(header: dict, key: str) -> list:
    names = header.get(key, [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise WireError(f"header '{key}' must be a list of variable names")
    if len(set(names)) != len(names):
        raise WireError(f"header '{key}' names a variable twice")
    return names
