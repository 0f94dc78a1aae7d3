"""TorchRec interop: KeyedJaggedTensor / KeyedTensor to and from deeprec batches, and a drop-in
`EmbeddingBagCollection` built on deeprec's fused lookup (EmbeddingCollection, EmbeddingVariables).

    raw batch --to_kjt (one op: hashing, missing ids dropped)--> KeyedJaggedTensor
              --EmbeddingBagCollection / EmbeddingCollection--> KeyedTensor [B, sum(D)]

Ids agree with deeprec's own models (`FeatureEmbedder.ids`): strings hashed with
`deeprec.ops` (63-bit keys, or buckets with `num_buckets`), ints kept (or taken mod
`num_buckets`), and a negative id (missing) becomes an empty bag, which pools to zeros as
deeprec's `prepare_bags` does. Conversions share memory where the layouts agree (int64 values
with int64 offsets): a single key's values and offsets, `from_kjt`'s values, `to_jagged`,
`from_jagged`, KeyedTensor values. Needs the extra `deeprec[torchrec]` (torchrec==1.9.2,
fbgemm-gpu-cpu==1.8.0); deeprec never imports torchrec unless it is given or asked for one.
"""
from __future__ import annotations

import math
import numbers
from typing import Mapping, Sequence

import torch
from torch import nn

from deeprec import ops
from deeprec.errors import ConfigError
from deeprec.ops.graph_op import op
from deeprec.nn.keyed import _torchrec, is_keyed_jagged_tensor, kjt_columns, to_keyed_tensor
from deeprec.ragged import Ragged

__all__ = ["to_kjt", "from_kjt", "to_jagged", "from_jagged", "to_keyed_tensor", "from_keyed_tensor",
           "kjt_columns", "is_keyed_jagged_tensor", "EmbeddingBagCollection"]


# -- raw batch -> KeyedJaggedTensor --------------------------------------------------------------
def _buckets_of(num_buckets, keys: Sequence[str]) -> dict:
    if num_buckets is None or isinstance(num_buckets, numbers.Integral):
        return dict.fromkeys(keys, num_buckets)
    unknown = sorted(set(num_buckets) - set(keys))
    if unknown:
        raise ConfigError(f"num_buckets names {', '.join(unknown)}, which are not among the keys {list(keys)}")
    return {k: num_buckets.get(k) for k in keys}


def _drop_missing(ids: torch.Tensor, offsets: torch.Tensor | None, rows: int):
    """(ids >= 0, lengths): a missing (negative) id leaves its bag shorter, as prepare_bags prunes it."""
    lengths = torch.ones(rows, dtype=torch.long) if offsets is None else offsets[1:] - offsets[:-1]
    missing = ids < 0
    # an exported program has no data-dependent branch: it always takes the general path
    if not torch.compiler.is_exporting() and not bool(missing.any()):
        return ids, lengths
    row = torch.arange(rows) if offsets is None else torch.repeat_interleave(torch.arange(rows), lengths)
    return ids[~missing], lengths - torch.zeros(rows, dtype=torch.long).index_add_(0, row, missing.long())


@op(outputs=2)
def kjt_parts(columns: Sequence, num_buckets: Sequence, hash: str = "siphash"):
    """(values, offsets) of a KeyedJaggedTensor over raw columns, key-major. One graph node, so
    SmartStage runs the hashing ahead of the step."""
    strings = [i for i, c in enumerate(columns) if isinstance(c, tuple) and Ragged(*c).is_strings]
    hashed = {}
    if strings:  # one native call for every string column
        cols = [Ragged(*columns[i]) for i in strings]
        if all(num_buckets[i] is None for i in strings):
            out = ops.string_to_hash_key(cols, hash)
        elif all(num_buckets[i] is not None for i in strings):
            out = ops.string_to_hash_bucket(cols, [num_buckets[i] for i in strings], hash)
        else:
            out = [ops.string_to_hash_key(c, hash) if num_buckets[i] is None else
                   ops.string_to_hash_bucket(c, num_buckets[i], hash) for i, c in zip(strings, cols)]
        hashed = dict(zip(strings, out))
    parts = []
    for i, col in enumerate(columns):
        n = num_buckets[i]
        if i in hashed:
            ids, offsets, rows = hashed[i], None, hashed[i].shape[0]
        elif isinstance(col, tuple):  # a sequence: Ragged of int64 ids or of strings
            r = ops.ragged_keys(col, hash) if n is None else ops.hash_ragged(col, n, hash)
            ids, offsets, rows = r.values, r.offsets, r.offsets.numel() - 1
        else:
            col = torch.as_tensor(col)
            if col.dim() != 1 or col.is_floating_point():
                raise ConfigError(f"column {i}: a KeyedJaggedTensor key takes int ids [B], a string column or "
                                  f"a sequence (deeprec.Ragged), got {col.dtype} {tuple(col.shape)}")
            ids, offsets, rows = (col.long() if n is None else ops.id_to_bucket(col.long(), n)), None, col.shape[0]
        kept, lengths = _drop_missing(ids, offsets, rows)
        parts.append((kept, lengths, offsets if kept is ids else None))
    if len(parts) == 1 and parts[0][2] is not None and not torch.compiler.is_exporting() and int(parts[0][2][0]) == 0:
        return parts[0][0], parts[0][2]  # the sequence's own tensors: no copy
    lengths = torch.cat([p[1] for p in parts])
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=offsets[1:])
    values = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts])
    return values, offsets


def to_kjt(batch: Mapping, keys: Sequence[str], *, num_buckets: int | Mapping[str, int] | None = None,
           hash: str = "siphash"):
    """A KeyedJaggedTensor of the batch's columns `keys`, ids as deeprec's models hash them:
    63-bit keys (EmbeddingVariables) or, with `num_buckets` (an int or {key: n}), ids in [0, n)."""
    keys = list(keys)
    absent = [k for k in keys if k not in batch] if isinstance(batch, Mapping) else []  # traced: a Proxy
    if absent:
        raise ConfigError(f"to_kjt: the batch has no column {', '.join(map(repr, absent))}; "
                          f"its columns: {', '.join(batch)}")
    buckets = _buckets_of(num_buckets, keys)
    values, offsets = kjt_parts([batch[k] for k in keys], [buckets[k] for k in keys], hash)
    return _torchrec().KeyedJaggedTensor(keys=keys, values=values, offsets=offsets)


# -- KeyedJaggedTensor -> deeprec -----------------------------------------------------------------
def from_kjt(kjt) -> dict[str, Ragged]:
    """{key: Ragged(ids, offsets)}: a deeprec sequence column per key (values shared, not copied)."""
    keys = list(kjt.keys())
    return dict(zip(keys, kjt_columns(kjt, keys, owner="from_kjt")))


def to_jagged(ragged: Ragged):
    """A TorchRec JaggedTensor sharing the Ragged's values and offsets (int ids, offsets from 0)."""
    if not isinstance(ragged.values, torch.Tensor) or ragged.is_strings:
        raise ConfigError("to_jagged takes a Ragged of int ids; hash strings first (deeprec.ops.ragged_keys)")
    return _torchrec().JaggedTensor(values=ragged.values, offsets=ragged.offsets)


def from_jagged(jt) -> Ragged:
    """A Ragged sharing the JaggedTensor's values and offsets."""
    return Ragged(jt.values(), jt.offsets())


def from_keyed_tensor(kt) -> dict[str, torch.Tensor]:
    """{key: [B, D]} views of a KeyedTensor's values."""
    return kt.to_dict()


# -- the drop-in EmbeddingBagCollection ------------------------------------------------------------
_POOLINGS = {"SUM": "sum", "MEAN": "mean"}


def _init_range(table) -> tuple[float, float]:
    """TorchRec's default init: uniform(-sqrt(1/n), sqrt(1/n)), unless the config says otherwise."""
    bound = math.sqrt(1.0 / table.num_embeddings)
    low = -bound if table.weight_init_min is None else table.weight_init_min
    high = bound if table.weight_init_max is None else table.weight_init_max
    return low, high


class EmbeddingBagCollection(nn.Module):
    """`torchrec.EmbeddingBagCollection` on deeprec's fused lookup: same configs
    (`EmbeddingBagConfig`), same call (`ebc(kjt) -> KeyedTensor`, keys in table order),
    so a TorchRec model switches by changing its import.

    Tables of one embedding dim share one `EmbeddingCollection` (one fused lookup);
    a table's extra `feature_names` share its rows. `embedding_variables=True` makes every
    table an EmbeddingVariable (unbounded int64 keys, no `num_embeddings` limit: what a PS
    serves), initialised with the table's range; `ev_option` sets filters, eviction, storage.
    Rows update with deeprec's row-sparse optimizers (`deeprec.optim.make_optimizer`).
    """

    def __init__(self, tables: Sequence, is_weighted: bool = False, device: torch.device | str | None = None, *,
                 embedding_variables: bool = False, ev_option=None):
        super().__init__()
        from deeprec.nn import EmbeddingCollection, EmbeddingFeature, EmbeddingVariableOption, InitializerOption

        if is_weighted:
            raise ConfigError("EmbeddingBagCollection(is_weighted=True): per-id weights are not supported; "
                              "deeprec pools with the tables' pooling (SUM | MEAN)")
        self._tables = list(tables)
        self._feature_names = [f for t in self._tables for f in t.feature_names]
        for what, names in (("table", [t.name for t in self._tables]), ("feature", self._feature_names)):
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ConfigError(f"EmbeddingBagCollection: {what} name {', '.join(map(repr, twice))} appears "
                                  "more than once")
        dims = list(dict.fromkeys(t.embedding_dim for t in self._tables))
        self.collections = nn.ModuleList()
        for dim in dims:
            features = []
            for t in (t for t in self._tables if t.embedding_dim == dim):
                pooling = getattr(t.pooling, "name", str(t.pooling)).upper()
                if pooling not in _POOLINGS:
                    raise ConfigError(f"EmbeddingBagConfig({t.name!r}).pooling={pooling}: deeprec pools with "
                                      f"{' | '.join(_POOLINGS)}")
                if not t.feature_names:
                    raise ConfigError(f"EmbeddingBagConfig({t.name!r}) has no feature_names")
                option = ev_option
                if embedding_variables and option is None:
                    low, high = _init_range(t)
                    option = EmbeddingVariableOption(InitializerOption(_Uniform(low, high)))
                owner, *sharing = t.feature_names
                features.append(EmbeddingFeature(owner, None if embedding_variables else t.num_embeddings,
                                                 combiner=_POOLINGS[pooling], ev_option=option))
                features += [EmbeddingFeature(f, combiner=_POOLINGS[pooling], table=owner) for f in sharing]
            collection = EmbeddingCollection(features, dim)
            collection.kjt_known = self._feature_names  # a key of another table is no error
            self.collections.append(collection)
        if not embedding_variables:
            with torch.no_grad():
                for t in self._tables:
                    self.table(t.name).uniform_(*_init_range(t))
        if device is not None and torch.device(device).type != "meta":
            self.to(device)

    # -- TorchRec's accessors -----------------------------------------------------------------------
    def embedding_bag_configs(self) -> list:
        return list(self._tables)

    def is_weighted(self) -> bool:
        return False

    def _place(self, table_name: str):
        """(collection, row offset) of a fixed table."""
        for t in self._tables:
            if t.name == table_name:
                collection = self.collections[[c.lookup.dim for c in self.collections].index(t.embedding_dim)]
                lookup = collection.lookup
                part = [f.name for f in lookup.features].index(t.feature_names[0])
                if lookup.hash_tables:
                    raise ConfigError(f"table {table_name!r} is an EmbeddingVariable: it has no fixed rows")
                return lookup, int(lookup.table_offsets[part])
        raise ConfigError(f"no table {table_name!r}; tables: {', '.join(t.name for t in self._tables)}")

    def table(self, name: str) -> torch.Tensor:
        """The rows of a fixed table [num_embeddings, dim]: a view of the fused weight."""
        lookup, start = self._place(name)
        size = next(t.num_embeddings for t in self._tables if t.name == name)
        return lookup.weight.data[start:start + size]

    def load_torchrec_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy a torchrec EmbeddingBagCollection's weights (`embedding_bags.<table>.weight`) in: all
        checked first (present, same shape), so a refused state changes no table."""
        keys = {t.name: f"embedding_bags.{t.name}.weight" for t in self._tables}
        for t in self._tables:
            key = keys[t.name]
            if key not in state_dict:
                raise ConfigError(f"load_torchrec_state_dict: no {key!r}; keys: {', '.join(state_dict)}")
            shape = tuple(self.table(t.name).shape)
            if tuple(state_dict[key].shape) != shape:  # copy_ would broadcast a [1, D] or [D] silently
                raise ConfigError(f"load_torchrec_state_dict: {key!r} is {tuple(state_dict[key].shape)}, table "
                                  f"{t.name!r} is {shape} (num_embeddings, embedding_dim)")
        with torch.no_grad():
            for t in self._tables:
                self.table(t.name).copy_(state_dict[keys[t.name]])

    # -- forward ---------------------------------------------------------------------------------------
    def forward(self, features):
        """KeyedJaggedTensor -> KeyedTensor [B, sum of dims], keys in table order."""
        if len(self.collections) == 1:  # features are declared in TorchRec's output order
            return self.collections[0](features)
        pooled = {}
        for collection in self.collections:
            pooled.update(collection(features).to_dict())
        dims = {f: t.embedding_dim for t in self._tables for f in t.feature_names}
        return _torchrec().KeyedTensor(keys=list(self._feature_names),
                                       length_per_key=[dims[f] for f in self._feature_names],
                                       values=torch.cat([pooled[f] for f in self._feature_names], dim=1))


class _Uniform:
    """An EV initializer uniform in [low, high] (a class, not a lambda: it pickles with a checkpoint)."""

    def __init__(self, low: float, high: float):
        self.low, self.high = low, high

    def __call__(self, tensor: torch.Tensor):
        return nn.init.uniform_(tensor, self.low, self.high)
