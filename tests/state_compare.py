"""State dicts compared by meaning: an EmbeddingVariable's rows sorted by key.

Two runs that insert the same keys in another order (micro-batches, SmartStage, shards) number
their rows differently; the same key must still hold the same values, slots, freq and version."""
import torch


def rows_by_key(state: dict) -> dict:
    """`state` with every EmbeddingVariable's per-row tensors (those beside its `keys`) in key order."""
    out = dict(state)
    for name, keys in state.items():
        if not name.endswith(".keys") or not isinstance(keys, torch.Tensor):
            continue
        prefix = name[: -len("keys")]
        order = torch.argsort(keys)
        for other, value in state.items():
            rest = other[len(prefix):]
            if (other.startswith(prefix) and "." not in rest.replace("slot.", "", 1) and isinstance(value, torch.Tensor)
                    and value.dim() > 0 and value.shape[0] == keys.shape[0]):
                out[other] = value[order]
    return out
