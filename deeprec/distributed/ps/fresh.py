"""A training Pull's new rows are not sent: the worker knows their values (its own initializer matrices).

    worker  Register ──> PS keeps each embedding's initializer matrix (the first one registered; its own
            default, InitializerOption's, where none is given) <── {"initializers": {name: digest}}
    worker  Pull {"omit_fresh": digest of the pull's variables' matrices, as the worker holds them} ──>
            PS: where that equals the digest of the matrices it holds, the keys it held are gathered as
            before, the keys the pull created are left out of values/{dim}, and fresh/{dim} (bool, one per
            row of that dim) marks them; otherwise it answers in full
    worker  each marked row = its variable's matrix row key % rows: the value the PS gave it (bitwise: the
            same float32 matrix, the same row), so the pull answers what a full pull answers.

A step of ids the PS has not seen (a job's first hours, a uniform id space) then sends ~one row in ten
back instead of all of them: 0.75 MB fewer per step at batch 512 x 26 tables, and the PS gathers and
packs only the rows it held. The PS checks the digest with every pull, so a worker whose matrices differ
from the PS's (another worker registered the variable first, a restarted PS) is answered in full. Only an
EmbeddingArena's rows are left out (a tiered arena answers in full), and only where all of a dim's rows
come from one arena.
"""
from __future__ import annotations

import hashlib

import torch


def matrix_digest(matrix: torch.Tensor) -> str:
    """A digest of an initializer matrix's float32 values and shape."""
    m = matrix.detach().cpu().float().contiguous()
    digest = hashlib.blake2b(str(list(m.shape)).encode(), digest_size=16)
    digest.update(m.numpy().tobytes())
    return digest.hexdigest()


def combined_digest(digests: dict[str, str], names: list[str]) -> str | None:
    """One digest of the matrices of `names`, in order (None if one of them has none)."""
    if any(n not in digests for n in names):
        return None
    return hashlib.blake2b("\n".join(digests[n] for n in names).encode(), digest_size=16).hexdigest()


def held_rows(rows: torch.Tensor, fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows of the places that were held before the pull, the mask of the places it created):
    `fresh` lists the places (positions in the request) that created a row."""
    mask = torch.zeros(rows.numel(), dtype=torch.bool)
    mask[fresh] = True
    return rows[~mask], mask


class Initializers:
    """The worker's initializer matrices, stacked per dim (row key % rows of a variable's span starts key k)."""

    def __init__(self):
        self.spans: dict[str, tuple[int, int]] = {}  # name -> (first row in its dim's stack, rows)
        self.matrices: dict[int, torch.Tensor] = {}  # dim -> the stacked matrices of that dim
        self.digests: dict[str, str] = {}

    def add(self, name: str, matrix: torch.Tensor) -> None:
        matrix = matrix.detach().cpu().float().contiguous()
        digest = matrix_digest(matrix)
        if self.digests.get(name) == digest:
            return
        dim = matrix.shape[1]
        held = self.matrices.get(dim)
        start = 0 if held is None else held.shape[0]
        # the stack grows first: a concurrent fill reading the old span still finds its rows
        self.matrices[dim] = matrix if held is None else torch.cat([held, matrix])
        self.spans[name] = (start, matrix.shape[0])
        self.digests[name] = digest

    def digest(self, names: list[str]) -> str | None:
        return combined_digest(self.digests, names)

    def snapshot(self) -> "Initializers":
        """These matrices as of now (a pull's digest and its fill use one, whatever a Register changes
        meanwhile); the stacks are shared, never written in place."""
        copy = Initializers()
        copy.spans, copy.matrices, copy.digests = dict(self.spans), dict(self.matrices), dict(self.digests)
        return copy

    def fill(self, values: torch.Tensor, fresh: torch.Tensor, keys: torch.Tensor, names: list[str],
             table: torch.Tensor, dim: int) -> torch.Tensor:
        """The full rows of a reply's dim: `values` holds the held places' rows in order, `fresh` marks
        the others; `keys` and `table` (index into `names`) give each place's key and variable. Raises
        ValueError, naming what does not fit, for a reply that cannot be such an answer."""
        if fresh.dtype != torch.bool or fresh.dim() != 1 or fresh.numel() != keys.numel():
            raise ValueError(f"fresh/{dim} must be bool [{keys.numel()}], got {str(fresh.dtype)[6:]} "
                             f"{list(fresh.shape)}")
        held = keys.numel() - int(fresh.sum())
        if values.dim() != 2 or list(values.shape) != [held, dim]:
            raise ValueError(f"values/{dim} must be [{held}, {dim}] (the rows of the keys held), got {list(values.shape)}")
        out = torch.empty(keys.numel(), dim)
        out[~fresh] = values
        places = torch.nonzero(fresh).squeeze(1)
        if places.numel():
            var = table[places]
            missing = [names[v] for v in torch.unique(var).tolist() if names[v] not in self.spans]
            if missing or dim not in self.matrices:
                raise ValueError(f"fresh/{dim} marks rows of {missing or names} whose initializer this worker lacks")
            start = torch.tensor([self.spans.get(n, (0, 1))[0] for n in names])
            count = torch.tensor([self.spans.get(n, (0, 1))[1] for n in names])
            out[places] = self.matrices[dim].index_select(0, start[var] + keys[places] % count[var])
        return out
