"""`Ragged`: the one variable-length column type of a raw batch (Arrow's list/binary layout).

    Ragged(values, offsets)      row b is values[offsets[b] : offsets[b + 1]], offsets int64 [B + 1]

    values uint8 [N]             a string column: row b is one string of bytes (Arrow binary)
    values int64 [N]             a sequence of ids (Arrow list<int64>)
    values Ragged of bytes       a sequence of strings (Arrow list<binary>)

Only tensors inside, so a batch holding Raggeds collates, moves with `.to(device)`,
pins, crosses processes and the PS wire without pickling, and flattens as a pytree
(a NamedTuple) for torch.export.
"""
from __future__ import annotations

import warnings
from typing import Iterable, NamedTuple, Union

import numpy as np
import pyarrow as pa
import torch



class Ragged(NamedTuple):
    values: Union[torch.Tensor, "Ragged"]
    offsets: torch.Tensor

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_strings(cls, items: Iterable) -> "Ragged":
        """A string column from Python `bytes` / `str` (UTF-8): for tests and hand-made batches."""
        raw = [s.encode() if isinstance(s, str) else bytes(s) for s in items]
        offsets = np.zeros(len(raw) + 1, dtype=np.int64)
        np.cumsum([len(s) for s in raw], out=offsets[1:])
        values = torch.frombuffer(bytearray(b"".join(raw)), dtype=torch.uint8) if offsets[-1] else \
            torch.empty(0, dtype=torch.uint8)
        return cls(values, torch.from_numpy(offsets))

    @classmethod
    def from_lists(cls, rows: Iterable[Iterable]) -> "Ragged":
        """A sequence column from Python lists of ints (int64 ids) or of strings (nested)."""
        rows = [list(r) for r in rows]
        flat = [v for r in rows for v in r]
        offsets = torch.tensor([0, *np.cumsum([len(r) for r in rows])], dtype=torch.long)
        if flat and isinstance(flat[0], (bytes, str)):
            return cls(cls.from_strings(flat), offsets)
        return cls(torch.tensor(flat, dtype=torch.long), offsets)

    @classmethod
    def from_arrow(cls, array) -> "Ragged":
        """A binary/string/list Arrow array (or chunked array); string bytes and int64 list values
        are taken zero-copy from Arrow's buffers. Nulls must have been filled first."""
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
        if array.null_count:
            raise ValueError(f"Ragged.from_arrow: the {array.type} array holds {array.null_count} nulls; "
                              "fill them first (an empty string or an empty list)")
        kind = array.type
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            array = array.view(pa.large_binary() if pa.types.is_large_string(kind) else pa.binary())
            kind = array.type
        if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
            wide = pa.types.is_large_binary(kind)
            offsets = np.frombuffer(array.buffers()[1], dtype=np.int64 if wide else np.int32,
                                    count=len(array) + 1, offset=array.offset * (8 if wide else 4))
            start, end = int(offsets[0]), int(offsets[-1])
            return cls(_bytes_tensor(array.buffers()[2], start, end), torch.from_numpy(offsets.astype(np.int64) - start))
        if pa.types.is_list(kind) or pa.types.is_large_list(kind):
            offsets = np.asarray(array.offsets.to_numpy(), dtype=np.int64)
            items = array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
            if pa.types.is_integer(items.type):
                values = torch.from_numpy(np.array(items.cast(pa.int64()).to_numpy(), dtype=np.int64))
            else:
                values = cls.from_arrow(items)
            return cls(values, torch.from_numpy(offsets - offsets[0]))
        raise TypeError(f"Ragged.from_arrow takes binary, string or list arrays, got {kind}")

    # -- views --------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return self.offsets.numel() - 1

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def is_strings(self) -> bool:
        """A string column (one string of bytes per row)."""
        return isinstance(self.values, torch.Tensor) and self.values.dtype == torch.uint8

    def slice_rows(self, start: int, end: int) -> "Ragged":
        """Rows [start, end), offsets rebased to 0 (values shared, not copied)."""
        a, b = int(self.offsets[start]), int(self.offsets[end])
        values = self.values.slice_rows(a, b) if isinstance(self.values, Ragged) else self.values[a:b]
        return Ragged(values, self.offsets[start:end + 1] - a)

    @staticmethod
    def cat(parts: list["Ragged"]) -> "Ragged":
        """Rows of several Raggeds, one after another (offsets rebased; e.g. DataLoader collation)."""
        if any(p.offsets[0] != 0 for p in parts):
            parts = [p.slice_rows(0, p.rows) for p in parts]
        if isinstance(parts[0].values, Ragged):
            values = Ragged.cat([p.values for p in parts])
        else:
            values = torch.cat([p.values for p in parts])
        shifts = torch.tensor([0, *np.cumsum([int(p.offsets[-1]) for p in parts[:-1]])], dtype=torch.long)
        offsets = torch.cat([parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, shifts)])
        return Ragged(values, offsets)

    def tolist(self) -> list:
        """Rows as Python objects: bytes for a string column, lists for a sequence."""
        off = self.offsets.tolist()
        if self.is_strings:
            data = self.values.numpy().tobytes()
            return [data[off[i]:off[i + 1]] for i in range(len(off) - 1)]
        items = self.values.tolist()
        return [items[off[i]:off[i + 1]] for i in range(len(off) - 1)]

    # -- devices --------------------------------------------------------------------------------
    def to(self, *args, **kwargs) -> "Ragged":
        return Ragged(self.values.to(*args, **kwargs), self.offsets.to(*args, **kwargs))

    def pin_memory(self, *args) -> "Ragged":
        return Ragged(self.values.pin_memory(*args), self.offsets.pin_memory(*args))

    def __repr__(self) -> str:
        kind = "strings" if self.is_strings else ("sequence of strings" if isinstance(self.values, Ragged)
                                                   else f"sequence of {self.values.dtype}")
        return f"Ragged({kind}, rows={self.rows}, values={self.values.numel() if isinstance(self.values, torch.Tensor) else self.values.rows})"


# Arrow buffers are immutable by contract and these tensors only read them: torch's warning
# about a non-writable buffer is silenced for this module's calls only.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__)


def _bytes_tensor(buffer, start: int, end: int) -> torch.Tensor:
    if end <= start or buffer is None:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=end - start, offset=start)


__all__ = ["Ragged"]


# a saved ExportedProgram (deeprec.serving) records its input layout, Ragged leaves included, by this name
torch.utils._pytree._register_namedtuple(Ragged, serialized_type_name="deeprec.ragged.Ragged")
