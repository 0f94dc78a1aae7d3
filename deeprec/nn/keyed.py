"""A KeyedJaggedTensor as EmbeddingCollection's input, and a KeyedTensor as its output (what
TorchRec's EmbeddingBagCollection takes and gives). torchrec is imported only when one is built;
a KJT is recognised by its type's name. The conversions of deeprec.interop.torchrec build on these.
"""
from __future__ import annotations

from typing import Sequence

import torch

from deeprec.errors import ConfigError
from deeprec.ops.graph_op import op
from deeprec.ragged import Ragged


def _torchrec():
    try:
        import torchrec.sparse.jagged_tensor as jagged
    except ImportError as err:
        raise ImportError("deeprec.interop.torchrec needs torchrec: pip install 'deeprec[torchrec]' "
                          "(torchrec==1.9.2 and fbgemm-gpu-cpu==1.8.0)") from err
    return jagged


def is_keyed_jagged_tensor(value) -> bool:
    """A TorchRec KeyedJaggedTensor, recognised without importing torchrec."""
    return type(value).__name__ == "KeyedJaggedTensor" and hasattr(value, "offsets") and hasattr(value, "keys")


def _bags_count(kjt, names, *args, **kwargs) -> int:
    return 2 * len(names)


@op(outputs=_bags_count)
def kjt_bags(kjt, names: Sequence[str], known: Sequence[str] | None = None, owner: str = "EmbeddingCollection"):
    """(values, offsets) of the KJT's keys `names`, flat: values are views, offsets rebased to 0
    (the first key's a view too). One graph node: traced, a KJT is a Proxy (torchrec's classes
    are proxyable), so the keys are checked here, on the real one. `known`: the keys accepted
    (default `names`); any other is an error, as it would be a feature silently not embedded."""
    if not is_keyed_jagged_tensor(kjt):
        raise ConfigError(f"{owner} takes a KeyedJaggedTensor here, got {type(kjt).__name__}")
    keys = list(kjt.keys())
    missing = [n for n in names if n not in keys]
    if missing:
        raise ConfigError(f"{owner}: the KeyedJaggedTensor has no key {', '.join(map(repr, missing))}; "
                          f"its keys: {', '.join(keys)}")
    known = list(names if known is None else known)
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise ConfigError(f"{owner}: KeyedJaggedTensor key {', '.join(map(repr, unknown))} is not one of its "
                          f"features ({', '.join(known)}); pass only those keys (kjt.permute / kjt.split)")
    if kjt.weights_or_none() is not None:
        raise ConfigError(f"{owner}: a weighted KeyedJaggedTensor (per-id weights) is not supported; "
                          "deeprec pools with the features' combiners (sum | mean | sqrtn)")
    if kjt.variable_stride_per_key():
        raise ConfigError(f"{owner}: a KeyedJaggedTensor with a variable batch per key is not supported")
    values, offsets = kjt.values(), kjt.offsets()
    if (offsets.numel() - 1) % len(keys):
        raise ConfigError(f"{owner}: a KeyedJaggedTensor with {len(keys)} keys has {offsets.numel() - 1} bags, "
                          "not one per row and key")
    rows = (offsets.numel() - 1) // len(keys)
    if not torch.compiler.is_exporting() and not getattr(kjt, "_deeprec_checked", False):
        check_lengths(keys, values.numel(), offsets, rows, owner)
        kjt._deeprec_checked = True  # once per batch: several collections may read one KJT
    out = []
    for k in (keys.index(n) for n in names):
        own = offsets[k * rows:(k + 1) * rows + 1]
        if torch.compiler.is_exporting():  # sizes are symbols: no branch on the values
            start, end = own[0].item(), own[-1].item()
            out += [values[start:end], own - own[0]]
            continue
        start, end = int(own[0]), int(own[-1])
        out += [values[start:end], own if start == 0 else own - start]
    return tuple(out)


def check_lengths(keys: Sequence[str], count: int, offsets: torch.Tensor, rows: int, owner: str) -> None:
    """A KJT's lengths, checked at the edge, before any lookup reads its values: each key's are >= 0
    and together they sum to the values' length (else ids would be dropped, or read past the end).
    On CPU (one copy of the offsets from a device); each error names the key."""
    offsets = offsets.detach().cpu()
    lengths = offsets[1:] - offsets[:-1]
    negative = torch.nonzero(lengths < 0)
    if negative.numel():
        i = int(negative[0])
        raise ConfigError(f"{owner}: KeyedJaggedTensor key {keys[i // rows]!r}: row {i % rows} has length "
                          f"{int(lengths[i])}; lengths must be >= 0")
    start, total = int(offsets[0]), int(offsets[-1] - offsets[0])
    if start != 0:
        raise ConfigError(f"{owner}: KeyedJaggedTensor key {keys[0]!r}: its offsets start at {start}, not 0")
    if total < count:
        raise ConfigError(f"{owner}: KeyedJaggedTensor lengths sum to {total} but it holds {count} values: the "
                          f"{count - total} after key {keys[-1]!r} (the last) would be dropped; lengths must sum to "
                          "the values' length")
    if total > count:
        k = int(torch.nonzero(offsets[rows::rows] > count)[0])  # the first key whose bags end past the values
        raise ConfigError(f"{owner}: KeyedJaggedTensor key {keys[k]!r}: its lengths reach id "
                          f"{int(offsets[(k + 1) * rows])} but it holds {count} values; lengths must sum to the "
                          "values' length")


def kjt_columns(kjt, names: Sequence[str], known: Sequence[str] | None = None,
                owner: str = "EmbeddingCollection") -> list[Ragged]:
    """The KJT's bags of `names` as deeprec ids, `Ragged(values, offsets)` (views)."""
    flat = kjt_bags(kjt, list(names), None if known is None else list(known), owner)
    return [Ragged(flat[2 * i], flat[2 * i + 1]) for i in range(len(names))]


def to_keyed_tensor(pooled: torch.Tensor, keys: Sequence[str], dim: int | None = None):
    """[B, F, D] pooled embeddings -> KeyedTensor [B, F*D] (a view), as an EmbeddingBagCollection
    returns. `dim`: D, given when `pooled` is traced (a Proxy has no concrete shape)."""
    dim = pooled.shape[-1] if dim is None else dim
    return _torchrec().KeyedTensor(keys=list(keys), length_per_key=[dim] * len(keys), values=pooled.flatten(1))
