"""What `deeprec.optimize` applies to a model (the seed's ConfigProto options), validated on
construction. Names and defaults follow DeepRec's SmartStage documentation (SmartStageOptions);
the options of a training run are in deeprec.train_config, which nests `Config` as `optimize`.
"""
from __future__ import annotations

from dataclasses import dataclass

from deeprec.options import check_fields, option

from deeprec.errors import ConfigError, OutOfRangeError
from deeprec.graph.multi_stream import MultiStreamOptions


def _positive(owner: str, **values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{owner}.{name} must be a positive int, got {value!r}")


def _exception_types(owner: str, name: str, value) -> tuple:
    types = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    for t in types:
        if not (isinstance(t, type) and issubclass(t, BaseException)):
            raise ConfigError(f"{owner}.{name} must hold exception classes, got {t!r}")
    return types


EXECUTORS = ("thread", "process", "auto")


@dataclass
class SmartStageOptions:
    """How the staged subgraph runs ahead of the training step (seed defaults).

    capacity: results buffered ahead; num_threads: runner threads executing the
    stage; num_clients: consumers taking results; timeout_millis: how long a
    finished result may wait for buffer space before it is dropped (logged and
    counted in `stats.dropped`); closed_exception_types end the stream cleanly;
    ignored_exception_types skip that batch. deeprec extensions: `ordered=False`
    lets results of several runner threads arrive in completion order;
    `executor="process"` runs the reader and the stage in one worker process,
    so Python-level preprocessing (which holds the GIL) overlaps the step;
    `executor="auto"` measures the stage and the step over the first batches and
    picks off, thread or process and the step's intra-op threads (deeprec.runtime.auto_stage).
    """

    capacity: int = option(1, "SmartStage: results buffered ahead", flag="--capacity", ge=1)
    num_threads: int = option(1, "SmartStage: runner threads executing the stage", flag="--stage-threads", ge=1)
    num_clients: int = option(1, "SmartStage: consumers taking results", flag="--stage-clients", ge=1)
    timeout_millis: int = option(300000, "SmartStage: how long a result waits for buffer space before it is "
                                 "dropped", flag="--stage-timeout-millis", ge=1)
    closed_exception_types: tuple = option((StopIteration, OutOfRangeError), cli=False, file=False)
    ignored_exception_types: tuple = option((), cli=False, file=False)
    use_stage_subgraph_thread_pool: bool = option(False, "SmartStage: run the stage in Config.stage_thread_pools",
                                                  flag="--stage-thread-pool")
    stage_subgraph_thread_pool_id: int = option(0, "SmartStage: which of Config.stage_thread_pools",
                                                flag="--stage-thread-pool-id", ge=0)
    stage_subgraph_stream_id: int = option(0, "SmartStage: CUDA stream of the stage's host-to-device copy",
                                           flag="--stage-stream-id", ge=0)
    name: str | None = option(None, "SmartStage: a name for its threads", flag="--stage-name")
    ordered: bool = option(True, "SmartStage: results in reader order (off: completion order)",
                           flag="--stage-ordered")
    executor: str = option("thread", "SmartStage: auto (measure the first batches, then pick off, thread or "
                           "process and the step's threads), thread, or a worker process (no GIL sharing)",
                           flag="--stage-executor", choices=EXECUTORS)

    def __post_init__(self):
        check_fields(self, ("optimize", "smart_stage_options"))  # types, bounds, choices: as declared
        self.closed_exception_types = _exception_types("SmartStageOptions", "closed_exception_types",
                                                       self.closed_exception_types)
        self.ignored_exception_types = _exception_types("SmartStageOptions", "ignored_exception_types",
                                                        self.ignored_exception_types)
        if self.executor == "process" and (self.num_threads != 1 or self.use_stage_subgraph_thread_pool):
            raise ConfigError("--stage-executor process runs one worker process: it needs --stage-threads 1 and "
                              "no --stage-thread-pool (SmartStageOptions num_threads=1, "
                              "use_stage_subgraph_thread_pool=False)")


@dataclass
class ThreadPoolOptions:
    """An independent pool for the stage subgraph (`use_stage_subgraph_thread_pool`).

    intra_op_threads: torch intra-op threads inside each pool thread; keep
    pool threads x intra_op_threads + the main step's threads <= cores.
    """

    num_threads: int = 1
    intra_op_threads: int = 1
    name: str | None = None

    def __post_init__(self):
        _positive("ThreadPoolOptions", num_threads=self.num_threads, intra_op_threads=self.intra_op_threads)


@dataclass
class Config:
    """What `deeprec.optimize` applies to a model.

    smart_stage: move the data-side subgraph into a background stage.
    stage_subgraph_on_cpu: on CUDA, run the stage on CPU into pinned memory and
        copy its tensors with one packed host-to-device copy on a side stream.
    stage_thread_pools: pools that `SmartStageOptions.stage_subgraph_thread_pool_id` indexes.
    main_threads: torch intra-op threads of the training step while the stage runs
        (None: cores minus the stage's threads, at least 1).
    async_embedding: with embeddings on parameter servers, pull a batch's rows in the
        stage's runner thread, right after its stage ran, instead of inside the step:
        the pull of batch t+1 overlaps batch t's compute. Rows are read before the
        updates of at most capacity + num_threads earlier steps have landed (bounded
        staleness, as DeepRec's async embedding); needs smart_stage=True.
    multi_stream: run independent branches of the step concurrently
        (dr.MultiStreamOptions(num_streams, policy)): CUDA streams on GPU, threads on CPU.
    micro_batch_num: split each batch into N micro-batches along dim 0; their
        gradients are accumulated (weighted by size) into one optimizer step.
    graph_fusion: compile the step with torch.compile (eager, with one warning, if it fails).
    bf16: run the step under torch.autocast(bfloat16); weights stay fp32. "auto": only
        where the hardware has fast bf16 (CUDA, or a CPU with AMX / AVX512-BF16); elsewhere
        fp32, and explain() says why.
    tf32: allow TF32 matmuls and convolutions on GPU.
    """

    smart_stage: bool = option(False, "run the data-side subgraph ahead in background")
    smart_stage_options: SmartStageOptions = option(factory=SmartStageOptions)
    stage_subgraph_on_cpu: bool = option(False, "CUDA: run the stage on CPU into pinned memory, one packed copy")
    stage_thread_pools: list = option(factory=list, cli=False, file=False)
    main_threads: int | None = option(None, "intra-op threads of the step while staging (default: cores - stage)",
                                      ge=1)
    async_embedding: bool = option(False, "PS worker with --smart-stage: pull batch t+1's embedding rows while "
                                   "batch t computes")
    multi_stream: MultiStreamOptions | None = option(None, defaults={"policy": "embedding"})
    micro_batch_num: int = option(1, "split each batch into N micro-batches, accumulate, one optimizer step",
                                  flag="--micro-batch", metavar="N", ge=1)
    graph_fusion: bool = option(False, "torch.compile the training step (graph fusion)", flag="--compile")
    bf16: bool | str = option(False, "run the step under autocast(bfloat16), fp32 weights; auto: only where the "
                              "hardware has fast bf16 (CUDA, AMX or AVX512-BF16 CPUs)", nargs="?", const="on",
                              choices=("on", "off", "auto"), parse=lambda v: {"on": True, "off": False}.get(v, v))
    tf32: bool = option(False, "allow TF32 matmuls on GPU")

    def __post_init__(self):
        check_fields(self, ("optimize",))
        if not isinstance(self.smart_stage_options, SmartStageOptions):
            raise ConfigError("smart_stage_options must be a deeprec.SmartStageOptions")
        self.stage_thread_pools = list(self.stage_thread_pools)
        for pool in self.stage_thread_pools:
            if not isinstance(pool, ThreadPoolOptions):
                raise ConfigError(f"stage_thread_pools must hold deeprec.ThreadPoolOptions, got {pool!r}")
        opts = self.smart_stage_options
        if opts.use_stage_subgraph_thread_pool:
            n = len(self.stage_thread_pools)
            if not 0 <= opts.stage_subgraph_thread_pool_id < n:
                declared = f"ids 0..{n - 1}" if n else "none"
                raise ConfigError(
                    f"SmartStageOptions.stage_subgraph_thread_pool_id={opts.stage_subgraph_thread_pool_id} "
                    f"but Config.stage_thread_pools declares {n} pool(s) ({declared})")
        if self.multi_stream is not None and not isinstance(self.multi_stream, MultiStreamOptions):
            raise ConfigError("multi_stream must be a deeprec.MultiStreamOptions or None")
        if self.multi_stream is not None and self.multi_stream.num_streams == 1:
            self.multi_stream = None  # one stream is the step as it is
        if self.micro_batch_num > 1 and (opts.executor == "process" or not opts.ordered):
            raise ConfigError("micro_batch_num > 1 regroups a batch's micro-batches in order: it needs "
                              "SmartStageOptions(executor='thread', ordered=True)")
        if self.graph_fusion and self.multi_stream is not None and self.multi_stream.policy != "none":
            raise ConfigError("graph_fusion=True compiles the step into one program; it cannot also be split "
                              "over streams: use one of graph_fusion and multi_stream")
        if self.bf16 not in (True, False, "auto"):
            raise ConfigError(f"Config.bf16 must be True, False or 'auto', got {self.bf16!r}")
        if self.async_embedding and not self.smart_stage:
            raise ConfigError("Config.async_embedding=True pulls rows in the SmartStage prefetch: "
                              "it needs smart_stage=True")

    def stage_pool(self) -> ThreadPoolOptions | None:
        opts = self.smart_stage_options
        return self.stage_thread_pools[opts.stage_subgraph_thread_pool_id] if opts.use_stage_subgraph_thread_pool else None
