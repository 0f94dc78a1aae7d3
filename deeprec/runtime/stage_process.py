"""The stage in a worker process (`SmartStageOptions(executor="process")`).

Python-level preprocessing (hashing strings, crossing features) holds the GIL,
so a stage thread and the training step take turns instead of overlapping. A
worker process has its own interpreter:

    worker process: reader -> stage(batch) -> pack tensors into one byte payload
        ──pipe: JSON header + raw payload (no pickle)──>
    runner thread (main process): unpack as tensor views -> bounded buffer -> step

The header is JSON and the payload raw bytes: nothing received is unpickled.
The worker starts with multiprocessing's "forkserver" (no fork of the threaded
training process): forked from a server process that imported torch and this
module once, so a second start (SmartStage auto's trial, then the run) costs a
fork, not another ~2 CPU-s import of torch. The reader and the stage must be
picklable (the stage is a torch.fx GraphModule, which is); the worker runs with
the environment of its start, as a spawned one does.
"""
from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import pickle
import signal
import traceback

import numpy as np

import torch

from deeprec.errors import ConfigError
from deeprec.ragged import Ragged

_ALIGN = 64


class StageStreamEnd(Exception):
    """The worker's source ended (a closed exception type)."""


class StageBatchIgnored(Exception):
    """The worker skipped a batch for an ignored exception type."""


class StageProcessError(RuntimeError):
    """Traceback text of an exception raised in the stage process."""


# -- encoding: JSON header + one aligned byte payload ------------------------------------------
def encode(value, chunks: list, offset: list) -> dict:
    def add(data: bytes) -> int:
        start = (offset[0] + _ALIGN - 1) // _ALIGN * _ALIGN
        if start > offset[0]:
            chunks.append(bytes(start - offset[0]))
        chunks.append(data)
        offset[0] = start + len(data)
        return start

    if isinstance(value, torch.Tensor):
        t = value.detach().contiguous().cpu()
        data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"k": "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "off": add(data), "n": len(data)}
    if isinstance(value, Ragged):  # before tuple: a Ragged is a NamedTuple
        return {"k": "ragged", "values": encode(value.values, chunks, offset),
                "offsets": encode(value.offsets, chunks, offset)}
    if isinstance(value, np.ndarray) and value.dtype == object:
        raise TypeError("a numpy object array cannot cross to the main process: string columns are "
                        "deeprec.Ragged of bytes (dr.Ragged.from_strings)")
    if isinstance(value, np.ndarray):
        return {"k": "array", "dtype": value.dtype.str, "shape": list(value.shape),
                "off": add(np.ascontiguousarray(value).tobytes()), "n": value.nbytes}
    if isinstance(value, (tuple, list)):
        return {"k": "tuple" if isinstance(value, tuple) else "list", "items": [encode(v, chunks, offset) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"k": "dict", "items": {k: encode(v, chunks, offset) for k, v in value.items()}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"k": "json", "v": value}
    raise TypeError(f"a stage output of type {type(value).__name__} cannot cross to the main process; "
                    "use SmartStageOptions(executor='thread')")


def decode(spec: dict, buf: torch.Tensor):
    kind = spec["k"]
    if kind == "tensor":
        dtype = getattr(torch, spec["dtype"])
        raw = buf[spec["off"]:spec["off"] + spec["n"]]
        return raw.view(dtype).reshape(spec["shape"]) if spec["n"] else torch.empty(spec["shape"], dtype=dtype)
    if kind == "ragged":
        return Ragged(decode(spec["values"], buf), decode(spec["offsets"], buf))
    if kind == "array":
        dtype = np.dtype(spec["dtype"])
        return buf.numpy()[spec["off"]:spec["off"] + spec["n"]].view(dtype).reshape(spec["shape"]).copy()
    if kind in ("tuple", "list"):
        items = [decode(s, buf) for s in spec["items"]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: decode(s, buf) for k, s in spec["items"].items()}
    return spec["v"]


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _describe(exc: BaseException) -> dict:
    cls = type(exc)
    return {"module": cls.__module__, "qualname": cls.__qualname__, "message": str(exc),
            "args": list(exc.args) if _jsonable(list(exc.args)) else [str(exc)],
            "attrs": {k: v for k, v in vars(exc).items() if _jsonable(v)} if hasattr(exc, "__dict__") else {},
            "traceback": "".join(traceback.format_exception(exc))}


def rebuild_exception(info: dict) -> BaseException:
    """The worker's exception as its own class where importable, with the remote traceback as cause."""
    try:
        cls = importlib.import_module(info["module"])
        for part in info["qualname"].split("."):
            cls = getattr(cls, part)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            raise TypeError
        exc = cls.__new__(cls)
        exc.args = tuple(info["args"])
        if hasattr(exc, "__dict__"):
            exc.__dict__.update(info["attrs"])
    except Exception:  # noqa: BLE001 - class not importable here: keep the text
        exc = RuntimeError(f"{info['qualname']}: {info['message']}")
    exc.__cause__ = StageProcessError("in the stage process:\n" + info["traceback"])
    return exc


# -- the worker -----------------------------------------------------------------------------------
def _send(conn, header: dict, payload: bytes = b"") -> None:
    header["size"] = len(payload)
    conn.send_bytes(json.dumps(header).encode())
    if payload:
        conn.send_bytes(payload)


def _worker(conn, environ: dict, work: bytes) -> None:
    os.environ.clear()  # the trainer's environment now (the fork server holds the one of its own start),
    os.environ.update(environ)  # before the reader and stage are unpickled: their imports may read it
    source, stage_fn, closed_types, ignored_types = pickle.loads(work)  # the trainer's own bytes, not input
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the trainer's to handle: it stops this process
    torch.set_num_threads(1)
    iterator = iter(source)
    try:
        while True:
            try:
                raw = next(iterator)
                state = source.state_dict() if hasattr(source, "state_dict") else None
                values = stage_fn(raw)
                chunks, offset = [], [0]
                spec = encode(values, chunks, offset)
                _send(conn, {"kind": "item", "values": spec, "state": state}, b"".join(chunks))
            except (StopIteration, *closed_types):
                _send(conn, {"kind": "end"})
                return
            except ignored_types as exc:
                _send(conn, {"kind": "skip", "error": _describe(exc)})
            except BaseException as exc:  # noqa: BLE001 - reported to the training loop
                _send(conn, {"kind": "error", "error": _describe(exc)})
                return
    except (BrokenPipeError, EOFError, OSError):
        return  # the main process closed the stage
    finally:
        conn.close()


class Prestaged:
    """A stage result received from the worker, with the reader position after it."""

    __slots__ = ("values", "state")

    def __init__(self, values, state):
        self.values, self.state = values, state


class ProcessSource:
    """Iterator over stage results computed in a worker process (forked from multiprocessing's forkserver)."""

    def __init__(self, source, stage_fn, closed_types: tuple, ignored_types: tuple, name: str = "stage"):
        try:
            work = pickle.dumps((source, stage_fn, tuple(closed_types), tuple(ignored_types)))
        except (TypeError, AttributeError, pickle.PicklingError) as err:
            raise ConfigError(f"SmartStageOptions(executor='process') starts the stage in a new process, "
                              f"so the reader and the stage must be picklable: {err}") from err
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])  # read once, when the server starts
        self._conn, child = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_worker, args=(child, dict(os.environ), work),
                                   name=f"deeprec-{name}-process", daemon=True)
        try:
            self.process.start()
        except BaseException:
            self._conn.close()
            raise
        finally:
            child.close()

    def __iter__(self):
        return self

    def __next__(self) -> Prestaged:
        try:
            header = json.loads(self._conn.recv_bytes())
            buf = bytearray(header["size"])
            if header["size"]:
                self._conn.recv_bytes_into(buf)
        except (EOFError, OSError):
            self.process.join(5)
            raise RuntimeError(f"stage process exited (exit code {self.process.exitcode}) "
                               "before the end of the stream") from None
        kind = header["kind"]
        if kind == "item":
            return Prestaged(decode(header["values"], torch.frombuffer(buf, dtype=torch.uint8)
                                    if buf else torch.empty(0, dtype=torch.uint8)), header["state"])
        if kind == "end":
            raise StageStreamEnd("stage process: end of stream")
        if kind == "skip":
            err = header["error"]
            raise StageBatchIgnored(f"{err['qualname']}: {err['message']}")
        raise rebuild_exception(header["error"])

    def close(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(10)
        self._conn.close()
