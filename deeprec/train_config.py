"""`TrainConfig`: everything `deeprec train` takes, in one section per concern (torchtitan's
job_config.py style). Each field is declared once, with its docstring under it:

    field ──> a flag of `deeprec train` (grouped by section in --help; the flag names are the
              flat names of before, e.g. --checkpoint-dir for checkpoint.dir)
          ──> a TOML key (`[checkpoint] dir = ...`; a flag's name works at the top level too)
          ──> a keyword of `TrainConfig.create(checkpoint={"dir": ...})` or `create(checkpoint_dir=...)`

`storage` is the EmbeddingVariables' own StorageOption (deeprec.nn.options), whose fields also
make the PS shard's flags; `optimize` is deeprec.optimize's Config. Choice lists come from
deeprec.choices. A section checks its own fields when built; rules across sections sit in
TrainConfig, and rules of a way of training in its Strategy.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from deeprec.choices import BAD_ROW_POLICIES, DENSE_MODES, NAN_POLICIES, PROTOCOLS
from deeprec.config import Config, SmartStageOptions
from deeprec.errors import ConfigError
from deeprec.models import MODELS
from deeprec.models.features import EMBEDDINGS
from deeprec.models.spec import SPEC_HELP
from deeprec.nn.options import StorageOption
from deeprec.optim import OPTIMIZERS
from deeprec.options import build, check_fields, check_keys, option, section_aliases
from deeprec.runtime.device import DEVICES

FOLLOW_CHECKPOINT_EVERY = 1000  # --checkpoint-every under --follow unless given


@dataclass
class DataConfig:
    """What the model trains and is evaluated on, read in batches."""

    paths: list[str] = option(factory=list, flag="--data", metavar="PATH")
    """TSV/CSV/Parquet files, folders or globs (default: the model's bundled real sample)"""
    eval_paths: list[str] = option(factory=list, flag="--eval-data", metavar="PATH")
    """evaluation files (default: none, or --eval-fraction)"""
    eval_fraction: float = option(0.0, ge=0.0, lt=1.0)
    """without eval data: hold out this share of the data (whole byte ranges); 0.2 on a bundled sample"""
    schema: str | None = option(None)
    """the data's columns: a preset (criteo, avazu, movielens, byterec, behavior) or a TOML schema file
    (default: the preset the data matches)"""
    batch_size: int = option(512, ge=1)
    """rows per training batch"""
    eval_batch_size: int = option(4096, ge=1)
    """rows per evaluation batch"""
    shuffle_buffer: int = option(0, ge=0)
    """rows shuffled in a buffer of this size (0: file order)"""
    on_bad_row: str = option("raise", choices=BAD_ROW_POLICIES)
    """a row that does not parse: stop with its file and line, or skip and count it"""
    follow: bool = option(False)
    """keep training as new files land under --data (each read once, in name order) until stopped or --steps"""
    follow_interval: float = option(10.0, gt=0, metavar="SECONDS")
    """--follow: seconds between looks for new files (a file is taken once it held still over one look)"""

    def __post_init__(self):
        check_fields(self, ("data",))


@dataclass
class ModelConfig:
    """Which model trains: a zoo name, or your own (module:attribute or file.py:attribute)."""

    name: str = option("dlrm", SPEC_HELP.format(zoo=", ".join(sorted(MODELS))), flag="--model")
    """a zoo model's name, or your own model: pkg.module:Attribute or path/to/file.py:Attribute"""
    embedding: str | None = option(None, choices=EMBEDDINGS)
    """a zoo model's tables: fused hashed tables (default), EmbeddingVariables (no buckets), or nn.Embedding"""
    overrides: dict = option(factory=dict, cli=False, key="model_overrides")
    """the model's own config fields (a TOML table: [model.overrides])"""

    def __post_init__(self):
        check_fields(self, ("model",))


@dataclass
class OptimizerConfig:
    """How the parameters are updated: the fused dense optimizer (torch.optim's kernels), its row-sparse twin for embeddings."""

    name: str = option("adam", flag="--optimizer", choices=OPTIMIZERS)
    """optimizer of every parameter (DeepRec modelzoo default: adam)"""
    lr: float = option(0.001, gt=0.0)
    """learning rate"""

    def __post_init__(self):
        check_fields(self, ("optimizer",))


@dataclass
class TrainingConfig:
    """The loop: how long, on what, and what a step that goes wrong does."""

    steps: int | None = option(None, ge=1)
    """total optimizer steps (resume counts the steps already done)"""
    epochs: int | None = option(None, ge=1)
    """passes over the data when --steps is not given (default 1)"""
    seed: int = option(0, ge=0)
    """seed of the model's initialization and the shuffle"""
    eval_every: int = option(0, ge=0)
    """steps between evaluations during training (0: only at the end)"""
    on_nan: str = option("raise", choices=NAN_POLICIES)
    """a step whose loss or dense gradient is not finite is never applied: stop with its step and reader
    position, or skip that batch and count it"""
    device: str = option("cpu", choices=DEVICES)
    """where the model trains: cpu, cuda (fixed tables too while they fit in its memory; EmbeddingVariables
    stay on the host) or auto (cuda if present)"""
    threads: int | None = option(None, ge=1)
    """torch intra-op threads"""
    progress: bool = option(True)
    """show a progress bar on a terminal"""
    log_dir: str | None = option(None)
    """write TensorBoard event files here as the run trains (loss, samples/s, step and stage time, evaluations,
    PS / all-to-all traffic, tier hit rates): one run per process (rank-R, worker-I subfolders)"""
    log_every: int = option(100, ge=1)
    """steps between the scalars written to --log-dir, and between the step lines printed where no progress bar
    shows (--no-progress, or no terminal)"""
    flush_denormal: bool = option(True)
    """flush denormal floats (tiny embedding weights slow CPU math ~2x)"""
    malloc_tuning: bool = option(False)
    """glibc mallopt: keep freed memory mapped (halves page faults per step)"""

    def __post_init__(self):
        check_fields(self, ("training",))
        if self.steps is not None and self.epochs is not None:
            raise ConfigError("give --steps or --epochs, not both")


@dataclass
class CheckpointConfig:
    """Periodic atomic checkpoints, and resuming from them exactly."""

    dir: str | None = option(None, flag="--checkpoint-dir")
    """folder of the checkpoints"""
    every: int | None = option(None, flag="--checkpoint-every", ge=0)
    """steps between checkpoints; 0: only at the end (default: 1000 under --follow, else 0)"""
    incremental_every: int = option(0, ge=0)
    """steps between incremental checkpoints (EmbeddingVariable rows touched since the last full one)"""
    resume: bool = option(False)
    """continue from the latest checkpoint in --checkpoint-dir"""

    def __post_init__(self):
        check_fields(self, ("checkpoint",))
        if self.resume and not self.dir:
            raise ConfigError("--resume needs --checkpoint-dir")


@dataclass
class ExportConfig:
    """Serving exports written while training (`deeprec serve` follows the folder)."""

    dir: str | None = option(None, flag="--export-dir")
    """folder of serving exports written while training (deeprec serve follows it)"""
    every: int = option(0, flag="--export-every", ge=0)
    """steps between full serving exports (with --export-dir; 0: only at the end)"""
    incremental_every: int = option(0, flag="--export-incremental-every", ge=0)
    """steps between serving deltas: EmbeddingVariable rows updated since the last export, and the dense weights"""
    compile: bool | None = option(None, flag="--export-compile")
    """full exports also hold the AOTInductor-compiled serving program (20-40 s of compiling each on 2 cores;
    without it deeprec serve runs the traced program, several times slower per request); default: on,
    or $DEEPREC_EXPORT_COMPILE (0: off)"""

    def __post_init__(self):
        check_fields(self, ("export",))
        if (self.every or self.incremental_every) and not self.dir:
            raise ConfigError("--export-every / --export-incremental-every need --export-dir")


@dataclass
class DistributedConfig:
    """A parameter-server worker's options (deeprec launch or TF_CONFIG make a process one); a torchrun
    rank needs none."""

    protocol: str = option("star_server", choices=PROTOCOLS)
    """parameter-server protocol of a PS worker (TF_CONFIG set)"""
    sync: bool = option(False)
    """PS workers: average every worker's gradients per step"""
    dense: str = option("allreduce", choices=DENSE_MODES)
    """PS workers: dense parameters replicated on the workers and averaged by all-reduce (only embedding rows
    go to the PSs), or kept on the PSs"""
    collective_timeout: float = option(120.0, ge=1, metavar="SECONDS")
    """collective training (torchrun ranks): the deadline of every collective (the rendezvous, the embedding
    exchange, the dense all-reduce, evaluation, the stop agreement); a rank stopped, killed or cut off makes
    the others exit with an error naming it within this plus 30 s"""
    ps_deadline: float = option(60.0, gt=0, metavar="SECONDS")
    """PS workers: how long a call to a PS that does not answer (a partition, a restart) is retried before the
    worker fails naming the PS; retries are exactly-once (a PS answers a repeated request without running it)"""

    def __post_init__(self):
        check_fields(self, ("distributed",))


@dataclass
class LaunchConfig:
    """deeprec launch's own options (not the worker command's)."""

    max_restarts: int = option(0, ge=0)
    """collective jobs (--collective): after a rank fails, stop every rank and start them all again, up to this
    many times (as torchrun --max-restarts); each restart resumes from the worker command's --checkpoint-dir"""

    def __post_init__(self):
        check_fields(self, ("launch",))


@dataclass
class TrainConfig:
    """Everything `deeprec train` takes (`deeprec train --help` lists it by section)."""

    data: DataConfig = option(factory=DataConfig)
    model: ModelConfig = option(factory=ModelConfig)
    optimizer: OptimizerConfig = option(factory=OptimizerConfig)
    training: TrainingConfig = option(factory=TrainingConfig)
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig)
    export: ExportConfig = option(factory=ExportConfig)
    storage: StorageOption = option(factory=StorageOption)
    distributed: DistributedConfig = option(factory=DistributedConfig)
    # deeprec.optimize's options; SmartStage's executor is "auto" here (measure, then pick off, thread or process)
    optimize: Config = option(factory=lambda: Config(smart_stage_options=SmartStageOptions(executor="auto")),
                              title="optimizations (deeprec.optimize)")

    def __post_init__(self):
        for f in dataclasses.fields(self):  # TrainConfig(steps=5): the flat keywords of before
            if not dataclasses.is_dataclass(getattr(self, f.name)):
                raise ConfigError(f"TrainConfig.{f.name} must be a {f.type} section; build a config from flat "
                                  f"names or tables with TrainConfig.create({f.name}=...)")
        if not self.data.paths:
            raise ConfigError("no training data: give --data PATH (TrainConfig.create(data=[paths]))")
        if self.data.follow and self.training.epochs:
            raise ConfigError("--follow reads each file once as it lands: drop --epochs (--steps bounds the run)")
        if self.data.follow and self.data.eval_fraction:
            raise ConfigError("--follow cannot hold out --eval-fraction of data still landing: give --eval-data")
        if self.checkpoint.every is None:  # a trainer that never ends keeps its work: docs/training.md
            self.checkpoint.every = FOLLOW_CHECKPOINT_EVERY if self.data.follow else 0
        if self.data.follow and self.optimize.smart_stage_options.executor == "process":
            raise ConfigError("--follow runs SmartStage's stage in a thread (the wait for new files must see a stop "
                              "request): give --stage-executor thread or auto")

    @classmethod
    def create(cls, **values) -> "TrainConfig":
        """From sections as dicts, or flags' names at the top level (a flag's old flat name):
        `TrainConfig.create(data=["a.tsv"], steps=100, checkpoint={"dir": "ck", "every": 50},
        optimize={"smart_stage": True, "smart_stage_options": {"capacity": 4}})`."""
        values = section_aliases(cls, values, where="TrainConfig.create")
        check_keys(values, cls, "TrainConfig.create", python=True)
        return build(cls, values)
