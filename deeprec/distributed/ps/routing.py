"""Where each row of a PS request goes (PSClient's routing): embedding keys to PS `key % 1000 % num_ps`."""
from __future__ import annotations

import torch

from deeprec.nn.variable import shard_of


class Routing:
    """Where each row of a request goes: tables ordered by dim (each dim's rows one
    contiguous span), one fused slice of keys per PS, and back. `client`: the PSClient (its num_ps and
    dims; not imported here, which would make the two modules import each other)."""

    def __init__(self, client, keys: dict[str, torch.Tensor], grads: dict | None = None):
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
