"""The training step's graph, with the passes that change how it runs:

    main graph ──multi_stream_pass──> StreamRunner (streams / threads)
               └─split_at_lookups──> lookups eager, dense segments under torch.compile
                                     (graph_fusion; a segment that fails runs eagerly, one warning)
    then bf16: the call runs under torch.autocast(bfloat16); parameters stay fp32.
"""
from __future__ import annotations

import contextlib
import logging
import os
import warnings

import torch
import torch.fx

from deeprec.config import Config
from deeprec.graph.lookup_split import dense_segments, split_at_lookups
from deeprec.graph.multi_stream import multi_stream_pass
from deeprec.runtime.stream_runner import StreamRunner

log = logging.getLogger("deeprec.optimize")


class _CompiledSegment(torch.nn.Module):
    """One dense segment under torch.compile; its first failure runs it eagerly from then on, with
    one warning (the step's `failed` says why)."""

    def __init__(self, eager: torch.fx.GraphModule, step: "CompiledStep"):
        super().__init__()
        self.eager = eager
        # static shapes first (a second batch size recompiles with dynamic ones); kept out of the
        # module tree so the segment's parameters are listed once
        self.__dict__["compiled"] = torch.compile(eager)
        from torch._functorch import config as functorch_config

        self._functorch = functorch_config
        self._step = step
        self.failed = False

    def forward(self, *args):
        if not self.failed:
            try:
                # the backward compiled with the forward (not lazily at the first backward, where its
                # failure would escape this fallback); a call that compiles nothing pays ~10 us for it
                with self._functorch.patch(force_non_lazy_backward_lowering=True):
                    return self.compiled(*args)
            except Exception as err:  # noqa: BLE001 - a missing compiler, an unsupported op: run eager
                self.failed = True
                self._step.fail(err)
        return self.eager(*args)


class CompiledStep:
    """The step with its dense segments compiled (deeprec/graph/lookup_split.py): the lookups run
    eagerly between them. `failed` is the first segment's failure, if any."""

    def __init__(self, gm: torch.fx.GraphModule):
        target = _step_graph(gm)
        split = split_at_lookups(target)
        segments = dense_segments(split)
        for name, segment in segments.items():
            setattr(split, name, _CompiledSegment(segment, self))
        self.segments = len(segments)
        self.failed: str | None = None
        if target is gm:
            self.run = split
        else:
            gm.submod_1 = split
            self.run = gm

    def fail(self, err: Exception) -> None:
        if self.failed is None:
            self.failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            warnings.warn(f"deeprec graph_fusion: torch.compile failed ({self.failed}); "
                          "that part of the step runs eagerly from now on", RuntimeWarning, stacklevel=3)

    def __call__(self, *args):
        return self.run(*args)


def _step_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The graph of the step itself: SmartStage's main side wraps it in one submodule."""
    inner = getattr(gm, "submod_1", None)
    return inner if isinstance(inner, torch.fx.GraphModule) else gm


class _Streamed(torch.nn.Module):
    """Stands in for the step's submodule: same parameters, run by the StreamRunner."""

    def __init__(self, gm: torch.fx.GraphModule, runner: StreamRunner):
        super().__init__()
        self.gm, self._runner = gm, runner

    def forward(self, *args):
        return self._runner(*args)


class MainStep:
    def __init__(self, gm: torch.fx.GraphModule, config: Config, device: torch.device):
        self.gm, self.config, self.device = gm, config, device
        self.streams: StreamRunner | None = None
        self.target = gm  # the graph whose nodes carry streams
        self.compiled: CompiledStep | None = None
        self._run = gm
        ms = config.multi_stream
        if ms is not None and ms.policy != "none":
            target = self.target = _step_graph(gm)
            multi_stream_pass(target, ms)
            self.streams = StreamRunner(target, ms.num_streams, device)
            if target is gm:
                self._run = self.streams
            else:
                gm.submod_1 = _Streamed(target, self.streams)
        elif config.graph_fusion:
            self.compiled = CompiledStep(gm)
            self._run = self.compiled
        if config.tf32 and device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self._stream_threads = None
        if self.streams is not None and device.type != "cuda" and self.streams.streams_used > 1:
            # each CPU stream is a thread with its own intra-op threads: stay within the cores
            self._stream_threads = max(1, (os.cpu_count() or 1) // self.streams.streams_used)

    @contextlib.contextmanager
    def _threads(self):
        if self._stream_threads is None or torch.get_num_threads() <= self._stream_threads:
            yield
            return
        saved = torch.get_num_threads()
        torch.set_num_threads(self._stream_threads)
        try:
            yield
        finally:
            torch.set_num_threads(saved)

    def __call__(self, *args):
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.bf16)
        with autocast, self._threads():
            return self._run(*args)
