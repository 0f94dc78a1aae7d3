"""The wire format: a small JSON header and raw tensor bytes. No pickle.

    message = uint32 little-endian header length | JSON header | payload bytes

A header lists tensors as {"dtype", "shape", "off", "n"} slices of the payload.
`pack` copies each tensor into the message once (bytes.join over buffers);
`unpack` returns zero-copy read-only views, after checking every slice.
"""
from __future__ import annotations

import json
import struct
import warnings

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "bool": torch.bool}
SIZES = {name: torch.empty(0, dtype=dtype).element_size() for name, dtype in DTYPES.items()}
_LEN = struct.Struct("<I")
_ALIGN = 8


class WireError(ValueError):
    """A malformed message: its text is sent back as the gRPC error detail."""


class ResourceExhausted(WireError):
    """A request that would take the shard past its limits: RESOURCE_EXHAUSTED, nothing changed."""


def pack(header: dict, tensors: dict[str, torch.Tensor] | None = None) -> bytes:
    """Message with `header` plus each tensor, described under header["tensors"]."""
    parts, specs, offset = [], {}, 0
    for name, t in (tensors or {}).items():
        t = t.detach().contiguous().cpu()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise WireError(f"tensor {name!r}: dtype {dtype} cannot travel (allowed: {', '.join(DTYPES)})")
        pad = (-offset) % _ALIGN
        if pad:
            parts.append(bytes(pad))
            offset += pad
        view = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
        specs[name] = {"dtype": dtype, "shape": list(t.shape), "off": offset, "n": int(view.nbytes)}
        parts.append(memoryview(view).cast("B"))
        offset += view.nbytes
    head = json.dumps({**header, "tensors": specs}).encode()
    head += b" " * (-(_LEN.size + len(head)) % _ALIGN)  # JSON allows trailing blanks: the payload
    # then starts aligned, so a received tensor is a view (a bytes object's data is 16-aligned)
    return b"".join([_LEN.pack(len(head)), head, *parts])


def unpack(message: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    """(header, tensors) of a message; WireError naming what is wrong."""
    if len(message) < _LEN.size:
        raise WireError("message shorter than its length prefix")
    (head_len,) = _LEN.unpack_from(message)
    if head_len > len(message) - _LEN.size:
        raise WireError(f"header length {head_len} exceeds the message ({len(message)} bytes)")
    try:
        header = json.loads(bytes(memoryview(message)[_LEN.size:_LEN.size + head_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WireError(f"header is not JSON: {err}") from None
    except RecursionError:
        raise WireError("header JSON is nested too deeply") from None
    if not isinstance(header, dict) or not isinstance(header.get("tensors", {}), dict):
        raise WireError("header must be a JSON object with a 'tensors' object")
    base = _LEN.size + head_len
    payload_len = len(message) - base
    tensors = {}
    with warnings.catch_warnings():  # read-only views of the received bytes, by design
        warnings.simplefilter("ignore", UserWarning)
        for name, spec in header.get("tensors", {}).items():
            try:
                dtype = DTYPES[spec["dtype"]]
                shape, off, n = [int(d) for d in spec["shape"]], int(spec["off"]), int(spec["n"])
            except (KeyError, TypeError, ValueError, OverflowError):
                raise WireError(f"tensor {name!r}: spec needs dtype (one of {', '.join(DTYPES)}), shape, off, "
                                "n") from None
            count = 1
            for d in shape:  # Python ints: a huge shape cannot overflow into a small byte count
                count *= d
            if len(shape) > 16 or any(d < 0 for d in shape) or count * SIZES[spec["dtype"]] != n:
                raise WireError(f"tensor {name!r}: shape {shape} of {spec['dtype']} is not {n} bytes")
            if off < 0 or off + n > payload_len:
                raise WireError(f"tensor {name!r}: bytes [{off}, {off + n}) outside the {payload_len}-byte payload")
            if not n:
                tensors[name] = torch.empty(shape, dtype=dtype)
                continue
            raw = torch.frombuffer(message, dtype=torch.uint8, count=n, offset=base + off)
            if raw.data_ptr() % _ALIGN:  # bytes objects need not be aligned: copy rather than misread
                raw = raw.clone()
            tensors[name] = raw.view(dtype).reshape(shape)
    return header, tensors
