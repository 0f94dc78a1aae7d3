"""`deeprec.optimize`: capture, apply the passes, and run the result.

    fast = dr.optimize(model, dr.Config(smart_stage=True))
    fast(batch)                      # stage then main, same outputs as model(batch)
    out = fast.forward_backward(batch)   # forward and backward (per micro-batch); then optimizer.step()
    for out in fast.iterate(reader): # stage runs ahead in background threads
        ...
    with dr.make_prefetch_hook(fast, reader) as batches:   # hand-written loop
        for staged in batches:
            out = fast(staged)       # only the main step runs here
"""
from __future__ import annotations

import dataclasses
import operator
from collections import Counter

import torch
import torch.fx
from torch import nn
from torch.profiler import record_function

from deeprec.config import Config
from deeprec.graph.capture import capture
from deeprec.models.spec import check_outputs
from deeprec.graph.markers import staged
from deeprec.graph.shared_calls import merge_shared_calls
from deeprec.graph.smart_stage import StagePartition, smart_stage_pass
from deeprec.graph.multi_stream import stream_summary
from deeprec.nn.lookup import EmbeddingLookup, embedding_lookups
from deeprec.nn.tiered import describe_tiers, tier_summary
from deeprec.runtime.auto_stage import run_auto
from deeprec.runtime.hardware import fast_bf16
from deeprec.runtime.hook import make_prefetch_hook
from deeprec.runtime.main_step import MainStep
from deeprec.runtime.micro_batch import (MicroBatchSource, batch_rows, combine_outputs, deferred_lookups,
                                         split_batch)
from deeprec.runtime.prefetch import StagedBatch
from deeprec.runtime.transfer import make_ready


def _device_of(model: nn.Module) -> torch.device:
    """The step's device: the trained parameters' (a fixed table kept on the host takes no gradient)."""
    params = list(model.parameters())
    for p in params:
        if p.requires_grad:
            return p.device
    return params[0].device if params else torch.device("cpu")


class OptimizedModel(nn.Module):
    """The user's model with deeprec's passes applied; parameters stay the model's own."""

    def __init__(self, model: nn.Module, config: Config | None = None):
        super().__init__()
        self.model = model
        self._outputs_checked = False
        config = config or Config()
        self.device = _device_of(model)
        self.bf16_note = None
        if config.bf16 == "auto":  # resolved once, by the hardware the step runs on
            enabled, self.bf16_note = fast_bf16(self.device)
            config = dataclasses.replace(config, bf16=enabled)
        self.config = config
        self.graph_module = capture(model)
        self.merged_calls = merge_shared_calls(self.graph_module)  # a pure op called twice on the same inputs
        has_marker = any(n.op == "call_function" and n.target is staged for n in self.graph_module.graph.nodes)
        self.partition: StagePartition | None = None
        if config.smart_stage or has_marker:
            self.partition = smart_stage_pass(self.graph_module, smart_stage=config.smart_stage)
        # lookups fed by the stage that prepare batch t+1's rows while batch t trains: (lookup, index of
        # its keys in the cut); PS pulls read the rows ahead (opt-in), tiered storage only moves them
        self.async_lookups: list[tuple[EmbeddingLookup, int]] = []
        if config.async_embedding:
            self.async_lookups = _prefetching_lookups(self.graph_module, self.partition, reads_rows=True)
        self.tier_lookups = _prefetching_lookups(self.graph_module, self.partition, reads_rows=False)
        self.main_step: MainStep | None = None  # streams / compile / bf16 applied to the step's graph
        if (config.multi_stream is not None and config.multi_stream.policy != "none") or config.graph_fusion \
                or config.bf16 or config.tf32:
            self.main_step = MainStep(self.partition.main if self.staged else self.graph_module, config, self.device)
        if not self.staged and self.main_step is None:
            self.merged_calls = 0  # the model runs as written: the captured graph only describes it
        self.last_source_state = None  # reader position after the last batch iterate() yielded
        self.prefetch_stats = None
        self.auto_decision = None  # SmartStageOptions(executor="auto"): what it picked and why
        # a lookup whose backward pairs with other ranks': a step's backward always runs
        self.collective = any(lookup.must_run_backward for _, lookup in embedding_lookups(model))

    @property
    def staged(self) -> bool:
        return self.partition is not None and self.partition.stage is not None

    def stage(self, batch) -> StagedBatch:
        """Run the stage subgraph on a raw batch (what the runner threads do)."""
        with record_function("deeprec.stage"):
            return StagedBatch(self.partition.stage(batch), seq=-1)

    def forward(self, batch):
        if not self.staged:
            if isinstance(batch, StagedBatch):
                raise TypeError("this model has no stage: call it with the raw batch")
            if self.main_step is not None:
                with record_function("deeprec.main"):
                    return self.main_step(batch)
            return self.model(batch)
        item = batch if isinstance(batch, StagedBatch) else self.stage(batch)
        with record_function("deeprec.main"):
            return (self.main_step or self.partition.main)(*make_ready(item, self.device))

    def forward_backward(self, batch) -> dict:
        """Forward and backward of one batch (per micro-batch when micro_batch_num > 1);
        gradients accumulate in `.grad`. Returns the outputs, detached, loss averaged.
        The caller then runs `optimizer.step()` (the optimizer step)."""
        n = self.config.micro_batch_num
        if n == 1:
            return self._accumulate([batch], [1])
        if isinstance(batch, StagedBatch):
            raise TypeError("micro-batching splits the raw batch: call forward_backward() with it "
                            "(iterate() stages ahead)")
        parts = split_batch(batch, n)
        return self._accumulate(parts, [batch_rows(p) for p in parts])

    def _accumulate(self, items: list, sizes: list[int]) -> dict:
        """Forward and backward of each micro-batch; the embedding rows of lookups that update
        in backward are kept over all of them, for the optimizer's step (deeprec.optim.OptimizerGroup)."""
        total, outputs = sum(sizes), []
        deferred = deferred_lookups(self.model) if len(items) > 1 else []
        for lookup in deferred:
            lookup.check_applied()
            lookup.defer_updates(True)
        finite = True
        try:
            for item, size in zip(items, sizes):
                out = self(item)
                if not self._outputs_checked:  # the model contract, before anything reads out["loss"]
                    check_outputs(out, type(self.model).__name__)
                    self._outputs_checked = True
                outputs.append(out)
                # a non-finite loss never reaches backward: the fused embedding update runs there (a
                # collective model's backward still runs: the other ranks' exchanges wait for it)
                loss_finite = bool(torch.isfinite(out["loss"]))
                finite = finite and loss_finite
                if not loss_finite and not self.collective:
                    break
                with record_function("deeprec.backward"):
                    (out["loss"] * (size / total)).backward()
        finally:
            for lookup in deferred:
                lookup.defer_updates(False)
        if not finite:
            return {**combine_outputs(outputs[-1:], [1]), "nonfinite": "loss"}
        out = combine_outputs(outputs, sizes)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None and not p.grad.is_sparse]
        if grads and not bool(torch.stack(torch._foreach_norm(grads)).isfinite().all()):
            out["nonfinite"] = "gradient"
        return out

    def train_steps(self, reader, updater):
        """The training loop's steps: for each batch, `updater.before_step()`, forward and
        backward (the stage ahead, micro-batches, streams as configured), `updater.apply()`;
        yields (outputs, reader position after that batch) once the update is applied.
        A step whose loss or dense gradient is not finite is not applied
        (`updater.discard()`); its outputs carry "nonfinite" ("loss" or "gradient")."""
        for out in self.iterate(reader, backward=True, before_step=updater.before_step):
            with record_function("deeprec.update"):
                updater.discard() if "nonfinite" in out else updater.apply()
            yield out, self.last_source_state

    def iterate(self, reader, backward: bool = False, before_step=None):
        """Yield the outputs for each batch of `reader`, the stage running ahead.

        backward=True: each batch is a training step (`forward_backward()`: per micro-batch,
        gradients accumulated); call `optimizer.step()` after each. `before_step()`
        runs before each batch's forward (e.g. a PS pull). A generator: leaving the
        loop early closes it and joins the stage threads.
        """
        n = self.config.micro_batch_num if backward else 1
        if not self.staged:
            for batch in reader:
                if before_step is not None:
                    before_step()
                out = self.forward_backward(batch) if backward else self(batch)
                self.last_source_state = reader.state_dict() if hasattr(reader, "state_dict") else None
                yield out
            return
        if self.config.smart_stage_options.executor == "auto" and n == 1 and not (self.async_lookups or
                                                                                  self.tier_lookups):
            step = (lambda item: self._accumulate([item], [1])) if backward else self
            for out, state in run_auto(self, reader, step, before_step):
                self.last_source_state = state
                yield out
            return
        source = MicroBatchSource(reader, n) if n > 1 else reader
        with make_prefetch_hook(self, source) as batches:
            self.prefetch_stats = batches.stats
            staged = iter(batches)
            for item in staged:
                if before_step is not None:
                    before_step()
                if not backward:
                    out = self(item)
                else:
                    items = [item]
                    sizes = source.sizes.popleft() if n > 1 else [1]
                    items += [next(staged) for _ in range(len(sizes) - 1)]
                    out = self._accumulate(items, sizes)
                    item = items[-1]
                self.last_source_state = item.source_state
                yield out

    def explain(self) -> str:
        return explain(self)


def _stage_fed_lookups(gm: torch.fx.GraphModule, partition: StagePartition | None, wanted) -> list:
    """The lookup modules (`wanted(module)`) whose keys come out of the stage, with their index in the cut."""
    cut = partition.cut if partition is not None and partition.stage is not None else []
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and wanted(gm.get_submodule(node.target)):
            keys = node.args[0] if node.args else None
            if isinstance(keys, torch.fx.Node) and keys.name in cut:
                found.append((gm.get_submodule(node.target), cut.index(keys.name)))
    return found


def _prefetching_lookups(gm: torch.fx.GraphModule, partition: StagePartition | None, reads_rows: bool) -> list:
    """The lookups fed by the stage that can prefetch: those whose prefetch reads the rows (a PS
    pull, `reads_rows=True`), or those whose prefetch only moves them (tiered storage)."""
    return _stage_fed_lookups(gm, partition, lambda module: isinstance(module, EmbeddingLookup)
                              and module.can_prefetch and module.prefetch_reads_rows == reads_rows)




def optimize(model: nn.Module, config: Config | None = None) -> OptimizedModel:
    """Capture `model.forward` and apply the passes `config` asks for."""
    return OptimizedModel(model, config)


def explain(fast: OptimizedModel) -> str:
    name = type(fast.model).__name__
    part = fast.partition
    lines = [f"{name}.forward: {sum(1 for _ in fast.graph_module.graph.nodes)} graph nodes"]
    if fast.merged_calls:
        lines.append(f"shared calls: {fast.merged_calls} repeated call(s) of a pure deeprec op on the same inputs "
                     "merged into one (graph/shared_calls.py)")
    if part is None:
        lines.append("SmartStage off (dr.Config(smart_stage=True) enables it).")
        return "\n".join(lines + _explain_step(fast))
    nodes = {n.name: n for n in fast.graph_module.graph.nodes}
    columns = [nodes[n].args[1] for n in part.stage_nodes
               if nodes[n].target is operator.getitem and nodes[n].args[0].op == "placeholder"]
    counts = Counter(getattr(nodes[n].target, "__name__", str(nodes[n].target)) for n in part.stage_nodes
                     if not (nodes[n].target is operator.getitem and nodes[n].args[0].op == "placeholder"))
    lines.append(f"SmartStage: smart_stage={fast.config.smart_stage}, manual dr.staged boundary: "
                 f"{'yes' if part.manual else 'no'}")
    lines.append(f"stage ({len(part.stage_nodes)} nodes, run ahead in background threads):")
    if columns:
        lines.append(f"  reads {len(columns)} batch columns: {', '.join(map(str, columns))}")
    lines.append("  ops: " + ", ".join(f"{t} x{c}" if c > 1 else t for t, c in counts.items()))
    lines.append(f"main ({len(part.main_nodes)} nodes, the training step)")
    def value_name(name: str) -> str:
        node = nodes.get(name)
        if node is not None and node.target is operator.getitem:
            return f"{node.args[0].name}[{node.args[1]!r}]"
        return name

    lines.append(f"cut ({len(part.cut)} values passed from stage to main): "
                 + ", ".join(value_name(n) for n in part.cut))
    if fast.config.smart_stage_options.executor == "auto":
        decided = fast.auto_decision
        lines.append(decided.summary() if decided is not None and decided.executor != "pending" else
                     "executor auto: iterate() measures the stage and the step over the first batches, then "
                     "picks off, thread or process and the step's intra-op threads")
    if fast.config.async_embedding:
        lines.append(f"async embedding: {len(fast.async_lookups)} lookup(s) pull their rows from the parameter "
                     "servers in the prefetch, right after their keys are staged")
    if fast.tier_lookups:
        lines.append(f"tiered storage: {len(fast.tier_lookups)} lookup(s) promote the next batch's rows from disk "
                     "into DRAM in the stage, right after its keys are staged")
    if part.kept:
        lines.append("data-side nodes kept in main, and why:")
        lines += [f"  {node}: {reason}" for node, reason in part.kept.items()]
    return "\n".join(lines + _explain_step(fast))


def _explain_step(fast: OptimizedModel) -> list[str]:
    cfg, step, lines = fast.config, fast.main_step, []
    for _, lookup in embedding_lookups(fast.model):  # e.g. collective training's sharding plans
        lines += lookup.explain()
    tiers = tier_summary(fast.model)
    if tiers is not None:
        lines.append(describe_tiers(tiers))
    if step is not None and step.streams is not None:
        ms = cfg.multi_stream
        lines.append(f"multi-stream: policy={ms.policy!r}, {step.streams.streams_used} of {ms.num_streams} "
                     f"streams used ({'CUDA streams' if fast.device.type == 'cuda' else 'one thread each on CPU'}):")
        for sid, names in stream_summary(step.target).items():
            shown = ", ".join(names[:12]) + (f", ... ({len(names)} nodes)" if len(names) > 12 else "")
            lines.append(f"  stream {sid}: {shown}")
    if cfg.micro_batch_num > 1:
        lines.append(f"micro-batch: each batch runs as {cfg.micro_batch_num} micro-batches, gradients accumulated")
    if cfg.graph_fusion:
        compiled = step.compiled if step is not None else None
        failed = compiled.failed if compiled is not None else None
        segments = f"{compiled.segments} dense segment(s)" if compiled is not None else "the step"
        lines.append(f"graph fusion: torch.compile of {segments}, the embedding lookups eager between them"
                     + (f" (a segment fell back to eager: {failed})" if failed else ""))
    if cfg.bf16:
        lines.append("bf16: the step runs under torch.autocast(bfloat16); weights and optimizer state stay fp32")
    if fast.bf16_note:
        lines.append(f"bf16 auto: {'on' if cfg.bf16 else 'off'}: {fast.bf16_note}")
    if not lines and fast.partition is None:
        lines.append("no other pass: the model runs as written.")
    return lines
