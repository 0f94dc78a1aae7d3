"""Running a graph whose nodes carry `meta["stream"]` (deeprec.graph.multi_stream).

    CPU:   stream 0 = the calling thread; stream s > 0 = worker thread s.
           Each runs its own nodes in graph order; an input from another
           stream is awaited on that node's event (a future), so branches overlap.
    CUDA:  one torch.cuda.Stream per id, driven from the calling thread in graph
           order; a cross-stream edge is an event the consumer's stream waits on,
           and the tensor is record_stream'ed on the consumer's stream. Autograd
           runs each backward op on the stream of its forward op, so backward
           follows the forward streams.

Gradient mode and autocast state are carried into the worker threads (both are
thread-local in torch). An error in any stream stops the others and is raised
in the caller with its traceback.
"""
from __future__ import annotations

import threading

import torch
import torch.fx
from torch.profiler import record_function

from deeprec.graph.multi_stream import STREAM_KEY


class _Abort(Exception):
    """Another stream failed: stop waiting."""


class StreamRunner:
    def __init__(self, gm: torch.fx.GraphModule, num_streams: int, device: torch.device):
        self.gm, self.num_streams, self.device = gm, num_streams, device
        self.nodes = [n for n in gm.graph.nodes]
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.output = next(n for n in self.nodes if n.op == "output")
        self.by_stream: dict[int, list[torch.fx.Node]] = {}
        for node in self.nodes:
            if node.op not in ("placeholder", "output"):
                self.by_stream.setdefault(node.meta.get(STREAM_KEY, 0), []).append(node)
        self._cuda_streams = None
        if device.type == "cuda":
            self._cuda_streams = [torch.cuda.current_stream(device)] + [
                torch.cuda.Stream(device) for _ in range(num_streams - 1)]

    @property
    def streams_used(self) -> int:
        return len(self.by_stream)

    def __call__(self, *args):
        if self._cuda_streams is not None:
            return self._run_cuda(args)
        return self._run_threads(args)

    def _interpreter(self, args) -> torch.fx.Interpreter:
        """An interpreter whose environment holds the arguments."""
        interp = torch.fx.Interpreter(self.gm, garbage_collect_values=False)
        for node, value in zip(self.placeholders, args, strict=True):
            interp.env[node] = value
        return interp

    def _result(self, interp: torch.fx.Interpreter):
        return interp.map_nodes_to_values(self.output.args[0], self.output)

    # -- CPU: one thread per stream ---------------------------------------------------------
    def _run_threads(self, args):
        interp = self._interpreter(args)
        env = interp.env
        done = {n: threading.Event() for s in self.by_stream.values() for n in s}
        errors: list[BaseException] = []
        grad_enabled = torch.is_grad_enabled()
        autocast = torch.is_autocast_enabled("cpu")
        autocast_dtype = torch.get_autocast_dtype("cpu")

        def run_stream(nodes):
            try:
                with torch.set_grad_enabled(grad_enabled), \
                        torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast):
                    for node in nodes:
                        for source in node.all_input_nodes:
                            if source in done:
                                while not done[source].wait(0.05):
                                    if errors:
                                        raise _Abort()
                                if errors:
                                    raise _Abort()
                        with record_function(f"deeprec.stream{node.meta.get(STREAM_KEY, 0)}"):
                            env[node] = interp.run_node(node)
                        done[node].set()
            except _Abort:
                pass
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.append(exc)
                for event in done.values():
                    event.set()

        workers = [threading.Thread(target=run_stream, args=(nodes,), name=f"deeprec-stream{s}", daemon=True)
                   for s, nodes in self.by_stream.items() if s != 0]
        for w in workers:
            w.start()
        run_stream(self.by_stream.get(0, []))
        for w in workers:
            w.join()
        if errors:
            raise errors[0]
        return self._result(interp)

    # -- CUDA: one torch.cuda.Stream per id --------------------------------------------------
    def _run_cuda(self, args):
        interp = self._interpreter(args)
        env = interp.env
        streams = self._cuda_streams
        events: dict[torch.fx.Node, torch.cuda.Event] = {}
        for node in self.nodes:
            if node.op in ("placeholder", "output"):
                continue
            s = node.meta.get(STREAM_KEY, 0)
            stream = streams[s]
            for source in node.all_input_nodes:
                if source in events and source.meta.get(STREAM_KEY, 0) != s:
                    stream.wait_event(events[source])
                    _record(env[source], stream)
            with torch.cuda.stream(stream):
                env[node] = interp.run_node(node)
            if any(u.meta.get(STREAM_KEY, 0) != s for u in node.users):
                event = torch.cuda.Event()
                event.record(stream)
                events[node] = event
        main = streams[0]
        for source in self.output.all_input_nodes:
            if source in events:
                main.wait_event(events[source])
                _record(env[source], main)
        return self._result(interp)


def _record(value, stream) -> None:
    if isinstance(value, torch.Tensor) and value.is_cuda:
        value.record_stream(stream)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _record(v, stream)
    elif isinstance(value, dict):
        for v in value.values():
            _record(v, stream)
