"""An export's weights mapped from tables.safetensors, not copied (`deeprec serve --workers N`: N
processes, one copy of the tables in the page cache).

    tables.safetensors: [8 bytes: header length n][header: JSON {name: {dtype, shape, data_offsets}}][data]
        ──torch.UntypedStorage.from_file(shared=False): mmap(MAP_PRIVATE) of the whole file──> one storage
        ──each tensor a view of it at 8 + n + its begin offset──> {name: tensor}

MAP_PRIVATE is copy-on-write: nothing written into a tensor ever reaches the file, and a write copies
only the pages it touches (the rest stay the page cache's, shared by every process that maps the
file). The mapping lives while a tensor of it does; deleting or renaming the file meanwhile is safe
(the inode stays), truncating or rewriting it in place is not (deeprec's writers never do: an export
is written beside and renamed in). A tensor whose offset is not a multiple of its item size (a 1-byte
tensor before it) is copied, since a typed view needs aligned data.
"""
from __future__ import annotations

import json
import math
import os

import torch

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def map_tensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file at `path`, as views of one private mapping of it. A file
    that is not one (a header out of bounds, an unknown dtype): ValueError naming the tensor."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length <= 0 or 8 + length > size:
            raise ValueError(f"{path}: not a safetensors file (header of {length} bytes, file of {size})")
        header = json.loads(f.read(length))
    storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=size)
    start, tensors = 8 + length, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES.get(info.get("dtype"))
            begin, end = (int(x) for x in info["data_offsets"])
            shape = tuple(int(d) for d in info["shape"])
        except (AttributeError, KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r}: its header entry lacks a dtype, data_offsets or "
                             "shape") from None
        if dtype is None or not 0 <= begin <= end <= size - start or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} ({info.get('dtype')}, {list(shape)}) does not fit the file")
        offset = start + begin
        if offset % dtype.itemsize == 0:
            tensors[name] = torch.empty(0, dtype=dtype).set_(storage, offset // dtype.itemsize, shape)
        else:  # a typed view needs aligned data: this one copied
            raw = torch.empty(0, dtype=torch.uint8).set_(storage, offset, (end - begin,))
            tensors[name] = raw.clone().view(dtype).reshape(shape)
    return tensors

