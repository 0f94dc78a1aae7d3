"""`deeprec` command line: train, launch, explain, evaluate, export, serve, data synth, data convert.

Errors reach the user as one line, no traceback: exit code 2 for usage and configuration
errors (deeprec.errors.ConfigError, a missing file), 1 for data and runtime errors.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from importlib import resources

from rich.console import Console
from rich.markup import escape

from deeprec.choices import ALLOCATORS, BAD_ROW_POLICIES, CARDINALITIES, SYNTH_KINDS
from deeprec.console import LogConsole, make_console
from deeprec.errors import ConfigError, DeepRecError
from deeprec.models import MODELS
from deeprec.models.features import EMBEDDINGS
from deeprec.models.spec import SPEC_HELP
from deeprec.models.spec import resolve as resolve_model
from deeprec.optim import OPTIMIZERS
from deeprec.report import summary_table, write_result
from deeprec.progress import configure as configure_progress

SAMPLE = "criteo_sample.txt"
MODEL_SAMPLES = {"din": "movielens_sample.txt", "dien": "movielens_sample.txt", "dssm": "movielens_sample.txt",
                 "mmoe": "byterec_sample.txt"}  # the real sample each model's smoke run uses
SAMPLE_NAMES = {SAMPLE: "200-row real Criteo sample", "movielens_sample.txt": "200-row real MovieLens sample",
                "byterec_sample.txt": "200-row real ByteRec sample"}


def sample_path(name: str = SAMPLE) -> str:
    """A real sample shipped inside the package (Criteo by default)."""
    return str(resources.files("deeprec.data").joinpath("samples", name))


def synthetic_files(rows: int, cardinalities: str, seed: int, console: Console,
                    kind: str = "criteo") -> tuple[str, str]:
    """Train and eval files of synthetic data, generated once into a cache folder."""
    from deeprec.data import write_behavior, write_synthetic

    from deeprec.data.stores import cache_root

    cache = cache_root()
    os.makedirs(cache, exist_ok=True)
    files = []
    for part, n, part_seed in (("train", rows, seed), ("eval", max(rows // 10, 1000), seed + 1_000_003)):
        label = cardinalities if kind == "criteo" else kind
        path = os.path.join(cache, f"synth-{label}-{n}-seed{part_seed}-{part}.tsv")
        if not os.path.exists(path):
            console.print(f"writing {n:,} synthetic rows to {path}")
            tmp = f"{path}.{os.getpid()}.tmp"  # workers of one job may write it at the same time
            if kind == "behavior":  # the same users and items in train and eval: one world seed
                write_behavior(tmp, n, seed=seed, sample_seed=part_seed)
            else:
                write_synthetic(tmp, n, cardinalities=cardinalities, seed=part_seed)
            os.replace(tmp, path)
        files.append(path)
    return files[0], files[1]


SMOKE_BATCH = 32  # rows per batch of a smoke run on a bundled sample (200 rows, 20% held out)


def strategy_from_env():
    """How this process trains, from its environment: a PS worker (TF_CONFIG, as deeprec launch and
    Kubeflow's TFJob set it), a torchrun rank (WORLD_SIZE > 1), or alone."""
    from deeprec.distributed import worker_task_from_env

    task = worker_task_from_env()
    if task is not None:
        from deeprec.distributed.ps.strategy import ParameterServer

        return ParameterServer(task.ps_addresses, task.index, task.num_workers, task.master), task.protocol
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        from deeprec.distributed.collective.strategy import Collective

        return Collective(int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])), None
    from deeprec.runtime.strategy import LocalStrategy

    return LocalStrategy(), None


def train_config(args, console: Console) -> tuple:
    """(TrainConfig, a note for the user, Strategy) from, in order: TrainConfig's defaults,
    `--config FILE`, the flags given; then the data (a bundled sample, --synthetic) and the way
    of training the environment says (a PS worker, a torchrun rank)."""
    from deeprec.options import build, given, load_toml, merge
    from deeprec.train_config import ModelConfig, TrainConfig, TrainingConfig

    values = load_toml(args.config, TrainConfig) if args.config else {}
    values = merge(values, given(args, TrainConfig))
    data, note = values.setdefault("data", {}), None
    # the sections read below are checked first: a wrong value is named, not a traceback
    model = build(ModelConfig, values.get("model", {}), ("model",)).name
    seed = build(TrainingConfig, values.get("training", {}), ("training",)).seed
    resolve_model(model)  # a wrong name or file fails before anything else
    strategy, protocol = strategy_from_env()
    if protocol:  # deeprec launch's --protocol
        values.setdefault("distributed", {})["protocol"] = protocol
    if args.synthetic is not None:
        if data.get("paths"):
            raise ConfigError("give --data or --synthetic, not both")
        kind = "behavior" if model in MODEL_SAMPLES else "criteo"
        train_file, eval_file = synthetic_files(args.synthetic, args.cardinalities, seed, console, kind)
        data["paths"], data["eval_paths"] = [train_file], data.get("eval_paths") or [eval_file]
    elif not data.get("paths"):
        sample = MODEL_SAMPLES.get(model, SAMPLE)
        data["paths"] = [sample_path(sample)]
        note = (f"smoke run on the bundled {SAMPLE_NAMES[sample]}" +
                (", 20% of it held out for eval: the AUC is noise" if strategy.world_size == 1 else "") +
                "; try --synthetic 1000000 for a meaningful run")
        if strategy.world_size == 1:
            data.setdefault("eval_fraction", 0.2)
        if "batch_size" not in data:  # the default 512 is more rows than the sample has
            data["batch_size"] = SMOKE_BATCH
            note += f"; batch size {SMOKE_BATCH} (the sample has fewer rows than the default 512)"
    return build(TrainConfig, values), note, strategy


def _rank_console(strategy) -> Console:
    """Under torchrun every rank's lines carry its rank (deeprec launch prefixes them itself)."""
    if strategy.world_size == 1 or os.environ.get("DEEPREC_LAUNCHED"):
        return make_console(stderr=True)

    class RankConsole(LogConsole):
        def print(self, *objects, **kwargs):
            super().print(escape(f"[rank {strategy.rank}]"), *objects, **kwargs)

    return RankConsole(stderr=True)


def cmd_train(args, console: Console) -> int:
    from deeprec.runtime.signals import Interrupted
    from deeprec.trainer import train

    cfg, note, strategy = train_config(args, console)
    console = _rank_console(strategy)
    configure_progress(console, enabled=cfg.training.progress)  # evaluation and export draw with the step bar
    if note and strategy.is_chief:
        console.print(f"[bold]{escape(note)}[/bold]")
    try:
        result = train(cfg, console, strategy=strategy)
    except Interrupted as stop:
        console.print(str(stop), highlight=False)
        return stop.exit_code
    if args.json or os.environ.get("DEEPREC_RESULT_DIR"):
        write_result(result, args.json, strategy)
    if strategy.is_chief:  # one summary per job
        Console().print(summary_table(cfg, result))
    else:
        evaluated = (f", eval AUC {result['eval']['auc']:.4f} on {result['eval']['rows']:,} eval rows"
                     if "eval" in result else "")
        console.print(f"rank {strategy.rank} finished: {result['steps']} steps, {result['rows']:,} rows, "
                      f"{result['samples_per_s']:,.0f} samples/s{evaluated} (rank 0 prints the summary)")
    return 0


def cmd_launch(args, console: Console) -> int:
    from deeprec.distributed.launch import launch
    from deeprec.options import build, given
    from deeprec.train_config import CheckpointConfig, DistributedConfig, LaunchConfig

    distributed = build(DistributedConfig, given(args, DistributedConfig, ("distributed",)))
    launching = build(LaunchConfig, given(args, LaunchConfig, ("launch",)), ("launch",))
    resume = given(args, CheckpointConfig, ("checkpoint",)).get("resume", CheckpointConfig.resume)  # its dir: train's
    train_args = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    return launch(args.ps, args.workers, distributed.protocol, train_args, sync=distributed.sync, resume=resume,
                  collective=args.collective, max_restarts=launching.max_restarts)


def cmd_explain(args, console: Console) -> int:
    import deeprec as dr
    from deeprec.data import resolve_schema
    from deeprec.models.spec import is_zoo, load_model

    from deeprec.data.reader import resolve_paths

    if args.data:
        resolve_paths(args.data, "--data")
    schema = resolve_schema(args.data or [sample_path()], args.schema) if args.data or args.schema else None
    overrides = {"embedding": args.embedding} if args.embedding and is_zoo(args.model) else {}
    if args.embedding and not is_zoo(args.model):
        raise ConfigError(f"--embedding chooses a zoo model's tables; {args.model!r} declares its own")
    if schema is None and not is_zoo(args.model):
        schema = resolve_schema([sample_path()], None)  # your model is built over Criteo's columns unless --data
    model = load_model(args.model, schema, **overrides)
    fast = dr.optimize(model, dr.Config(smart_stage=not args.no_smart_stage))
    print(fast.explain())
    if args.ranks:
        from deeprec.distributed.collective.planner import plan_model
        from deeprec.optim import make_optimizer

        make_optimizer(model, args.optimizer)  # its slots count in the tables' bytes
        print("\n".join(plan_model(model, args.ranks)))
    return 0


def cmd_export(args, console: Console) -> int:
    from deeprec.serving import export
    from deeprec.strategies import model_from_checkpoint

    from deeprec.serving.online import export_errors

    model, state, schema, path = model_from_checkpoint(args.checkpoint, args.model)
    with export_errors(args.out, int(state["step"]), flag="--out"):  # a full disk: one line, not a bug's
        out = export(model, args.out, schema=schema, model_name=state["model_name"], step=int(state["step"]),
                     compile=args.compile)
    console.print(f"exported {path} (step {state['step']}) to {out}")
    return 0


def cmd_serve(args, console: Console) -> int:
    from deeprec.serving.allocator import run_with

    run_with(args.allocator, args.argv)  # mimalloc: re-executes this command with it preloaded
    from deeprec.serving.server import serve

    from deeprec.security import read_token
    from deeprec.options import parse_bytes

    try:
        max_body = parse_bytes(args.max_body_bytes)
    except ValueError as err:
        raise ConfigError(f"--max-body-bytes: {err}") from None
    if max_body < 1:
        raise ConfigError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if args.token is not None and args.token_file is not None:
        raise ConfigError("give --token or --token-file, not both")
    if args.token is not None and not args.token.strip():
        raise ConfigError("--token is empty")
    token = args.token.strip() if args.token else read_token(args.token_file)  # else DEEPREC_PS_TOKEN, as the PS
    serve(args.model_dir, args.host, args.port, args.max_batch, args.max_wait_ms, args.threads, args.watch_interval,
          max_rows=args.max_rows, max_body_bytes=max_body, token=token, name=args.model_name,
          grpc_port=args.grpc_port, workers=args.workers)
    return 0


def cmd_evaluate(args, console: Console) -> int:
    from deeprec.data import open_reader
    from deeprec.metrics import evaluate, ranking_columns
    from deeprec.data.reader import resolve_paths
    from deeprec.strategies import model_from_checkpoint

    resolve_paths(args.data, "--data")  # before the checkpoint is read
    if args.predictions is not None:  # before the work: where the scores go
        if args.on_bad_row == "skip":
            raise ConfigError("--predictions writes one line per row of the data, in order: with --on-bad-row skip "
                              "its lines would no longer match the data's rows; give one or the other")
        folder = os.path.dirname(os.path.abspath(args.predictions))
        if os.path.isdir(args.predictions) or not os.path.isdir(folder):
            raise ConfigError(f"--predictions {args.predictions}: " + ("a folder; give a file name" if
                              os.path.isdir(args.predictions) else f"no folder {folder}"))
    model, state, schema, path = model_from_checkpoint(args.checkpoint, args.model)
    reader = open_reader(args.data, args.batch_size, schema=schema, on_bad_row=args.on_bad_row)
    if args.predictions is None:
        metrics = evaluate(model, reader, **ranking_columns(schema))
    else:
        metrics = _evaluate_writing(model, reader, args.predictions, ranking_columns(schema))
    console.print(f"{path} (step {state['step']}) on {', '.join(args.data)}"
                  + (f"; each row's score in {args.predictions}" if args.predictions else ""))
    print(json.dumps(metrics))
    return 0


def _evaluate_writing(model, reader, out: str, columns: dict) -> dict:
    """`evaluate`, also writing each row's score (its probability, as `deeprec serve` answers) to `out`
    in the order read: one per line, or for several labels a CSV with a header naming them. "%.9g"
    reads back as the same float32. Written beside `out` and renamed: never half a file."""
    import numpy as np
    import torch

    from deeprec.atomic import write_atomic
    from deeprec.metrics import evaluate

    labels = list(getattr(model, "label_columns", ("label",)))
    result = {}

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            if len(labels) > 1:
                f.write(",".join(labels) + "\n")

            def each(logits: torch.Tensor) -> None:
                scores = torch.sigmoid(logits.detach().float().cpu()).numpy()
                np.savetxt(f, scores.reshape(len(scores), -1), fmt="%.9g", delimiter=",")

            result.update(evaluate(model, reader, on_logits=each, **columns))

    write_atomic(out, write)
    return result


def cmd_synth(args, console: Console) -> int:
    from deeprec.data import write_behavior, write_synthetic

    if args.kind == "behavior":
        summary = write_behavior(args.out, args.rows, seed=args.seed)
    else:
        summary = write_synthetic(args.out, args.rows, cardinalities=args.cardinalities, seed=args.seed)
    print(json.dumps(summary))
    return 0


def cmd_convert(args, console: Console) -> int:
    from deeprec.data import file_format, open_reader, write_orc, write_parquet
    from deeprec.data.reader import resolve_paths

    files = resolve_paths(args.input, "input")
    out_format = "orc" if args.out.endswith(".orc") else "parquet"  # --out x.orc writes ORC (Hive/ODPS tables)
    if file_format(files[0]) == out_format:
        raise ConfigError(f"input: these are {'ORC' if out_format == 'orc' else 'Parquet'} files already; "
                          "data convert reads CSV/TSV (or the other columnar format)")
    reader = open_reader(files, 65536, schema=args.schema, on_bad_row=args.on_bad_row)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)  # a table's partition folder (dt=.../hour=...)
    rows = (write_orc if out_format == "orc" else write_parquet)(reader, args.out)
    print(json.dumps({"rows": rows, "out": args.out, "schema": reader.schema.name}))
    return 0


def at_least(low: int):
    """An argparse type: an int >= low (argparse names the flag and exits 2 otherwise)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {text}")
        return value
    parse.__name__ = f"int >= {low}"
    return parse


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    value = at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port, 0 to 65535, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from deeprec import __version__
    from deeprec.options import add_arguments
    from deeprec.train_config import CheckpointConfig, DistributedConfig, LaunchConfig, TrainConfig

    parser = argparse.ArgumentParser(prog="deeprec", description="Fast training of sparse CTR models.")
    parser.add_argument("--version", action="version", version=f"deeprec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    tr = sub.add_parser("train", help="train a model", formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Train a model. Every option is a field of a section of "
                                    "deeprec.trainer.TrainConfig (deeprec.train_config); --config FILE sets them from TOML "
                                    "(a table per section: [data], [checkpoint], [optimize.smart_stage_options], "
                                    "...; a flag's name works as a top-level key), flags override the file.")
    tr.add_argument("--config", metavar="FILE", help="a TOML file of TrainConfig fields")
    add_arguments(tr, TrainConfig)
    tr.add_argument("--synthetic", type=at_least(1), metavar="ROWS", help="train on ROWS synthetic rows (cached)")
    tr.add_argument("--cardinalities", "--synthetic-cardinalities", choices=CARDINALITIES, default="kaggle",
                    help="synthetic Criteo-layout data: Kaggle's column cardinalities or small ones")
    tr.add_argument("--json", help="write the result as JSON here (worker or rank R of several: <name>.rank-R.json)")
    tr.set_defaults(func=cmd_train)

    la = sub.add_parser("launch", help="run a parameter-server job, or a collective one, on this machine")
    la.add_argument("--ps", type=at_least(0), default=None, help="parameter servers (default 1; none with --collective)")
    la.add_argument("--collective", action="store_true", help="no PS: the workers are torch.distributed ranks "
                    "with sharded embeddings (as under torchrun)")
    la.add_argument("--workers", type=at_least(1), default=1, help="training processes (PS workers or ranks)")
    # the worker options launch itself acts on: the same fields as deeprec train's
    add_arguments(la, DistributedConfig, ("distributed",), exclude=("dense", "collective_timeout"))
    add_arguments(la, CheckpointConfig, ("checkpoint",), exclude=("dir", "every", "incremental_every"))
    add_arguments(la, LaunchConfig, ("launch",))
    la.add_argument("rest", nargs=argparse.REMAINDER, help="-- train ... (the worker command)")
    la.set_defaults(func=cmd_launch)

    ex = sub.add_parser("explain", help="show how deeprec.optimize partitions a model")
    ex.add_argument("--model", default="dlrm", help=SPEC_HELP.format(zoo=", ".join(sorted(MODELS))))
    ex.add_argument("--data", nargs="+", help="the data whose columns the model is built over (default: its preset)")
    ex.add_argument("--schema", help="the data's columns: a preset name or a TOML schema file")
    ex.add_argument("--no-smart-stage", action="store_true")
    ex.add_argument("--ranks", type=at_least(0), default=0, help="also show the collective sharding plan over N ranks")
    ex.add_argument("--embedding", choices=EMBEDDINGS, help="a zoo model's embedding kind (default: its own)")
    ex.add_argument("--optimizer", choices=OPTIMIZERS, default="adagrad",
                    help="with --ranks: its slots count in the tables' bytes")
    ex.set_defaults(func=cmd_explain)

    ev = sub.add_parser("evaluate", help="AUC and log loss of a checkpoint on data")
    ev.add_argument("--checkpoint", required=True, help="checkpoint file or folder (latest is used)")
    ev.add_argument("--data", nargs="+", required=True)
    ev.add_argument("--batch-size", type=at_least(1), default=4096)
    ev.add_argument("--on-bad-row", choices=BAD_ROW_POLICIES, default="raise")
    ev.add_argument("--model", help="build this model (module:attribute) instead of the one the checkpoint names")
    ev.add_argument("--predictions", metavar="FILE", help="also write each row's score here, in the data's order: "
                    "one per line (several labels: a CSV, a header naming them), to compare with deeprec serve")
    ev.set_defaults(func=cmd_evaluate)

    xp = sub.add_parser("export", help="a self-contained serving export of a checkpoint (deeprec.serving)")
    xp.add_argument("--checkpoint", required=True, help="checkpoint file or folder (latest is used)")
    xp.add_argument("--out", required=True, help="the export folder (replaced atomically)")
    xp.add_argument("--model", help="build this model (module:attribute) instead of the one the checkpoint names")
    xp.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="also write the AOTInductor-compiled program that deeprec serve runs (CPU, and CUDA where "
                         "a GPU is present; 20-40 s each on 2 cores) (default: on, or $DEEPREC_EXPORT_COMPILE)")
    xp.set_defaults(func=cmd_export)

    sv = sub.add_parser("serve", help="HTTP inference server of exports: /v1/predict, TF Serving's /v1/models "
                        "and the Open Inference Protocol (KServe v2, Triton) /v2/models, and its gRPC service "
                        "(--grpc-port)")
    sv.add_argument("model_dir", help="an export, a training's --export-dir (followed while serving), or a model "
                    "repository: a folder of those, each served under its folder name")
    sv.add_argument("--model-name", default=None, help="the name a single export is served under, in every URL "
                    "(/v1/models/NAME, /v2/models/NAME) and metadata answer (default: its folder's name)")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless given)")
    sv.add_argument("--port", type=port_number, default=8080, help="0: any free port (printed)")
    sv.add_argument("--grpc-port", type=port_number, default=None, metavar="PORT",
                    help="also serve the Open Inference Protocol's gRPC service (KServe v2 / Triton: "
                    "inference.GRPCInferenceService, tritonclient.grpc) on this port of --host, through the same "
                    "batchers; 0: any free port (printed: 'grpc listening on HOST:PORT'); off unless given")
    sv.add_argument("--max-batch", type=at_least(1), default=256, help="rows per model call, concurrent requests merged")
    sv.add_argument("--max-wait-ms", type=non_negative_float, default=0.0, help="extra wait for more requests to "
                    "batch (default 0: a batch is what queued while the previous one scored)")
    sv.add_argument("--threads", type=at_least(1), default=None, help="torch threads scoring (default: cores - 1; "
                    "with --workers N, per worker: max(1, cores // N - 1))")
    sv.add_argument("--workers", type=at_least(1), default=1, help="processes answering on the one port "
                    "(SO_REUSEPORT, under a supervisor that restarts one that dies); each loads the model (its tables "
                    "mapped: one copy in memory until a delta updates a table) and follows the export dir; /metrics "
                    "sums them (default 1: one process)")
    sv.add_argument("--watch-interval", type=positive_float, default=1.0,
                    help="seconds between looks for new deltas/full exports (MODEL_DIR a training's --export-dir)")
    sv.add_argument("--max-rows", type=at_least(1), default=8192, help="rows of one request (more: 400)")
    sv.add_argument("--max-body-bytes", default="8MiB", help="request body size (more: 413), e.g. 8MiB, 65536")
    sv.add_argument("--token", default=None, help="require 'Authorization: Bearer TOKEN' to predict and on model "
                    "routes (visible in ps: prefer --token-file or DEEPREC_PS_TOKEN)")
    sv.add_argument("--token-file", default=None, help="the token: this file's first line")
    sv.add_argument("--allocator", default=os.environ.get("DEEPREC_SERVE_ALLOCATOR", "auto"),
                    choices=ALLOCATORS, help="the C allocator: auto (default, or "
                    "$DEEPREC_SERVE_ALLOCATOR) is mimalloc where installed (5-18%% faster requests here), the "
                    "command re-executing itself with it preloaded; system: glibc's malloc")
    sv.set_defaults(func=cmd_serve)

    data = sub.add_parser("data", help="data tools").add_subparsers(dest="data_command", required=True)
    sy = data.add_parser("synth", help="write synthetic Criteo-layout TSV")
    sy.add_argument("--rows", type=at_least(1), required=True)
    sy.add_argument("--out", required=True)
    sy.add_argument("--kind", choices=SYNTH_KINDS, default="criteo",
                    help="Criteo layout, or behaviour sequences (DIN, DIEN, DSSM, MMoE)")
    sy.add_argument("--cardinalities", choices=CARDINALITIES, default="kaggle")
    sy.add_argument("--seed", type=at_least(0), default=0)
    sy.set_defaults(func=cmd_synth)
    cv = data.add_parser("convert", help="CSV/TSV to Parquet, or to ORC with --out x.orc (any schema)")
    cv.add_argument("input", nargs="+", help="CSV/TSV files, folders or globs, in any layout a schema describes")
    cv.add_argument("--schema", help="the data's columns: a preset (criteo, avazu, movielens, byterec, behavior) or "
                    "a TOML schema file (default: the preset the data matches); train on the result with the same "
                    "--schema")
    cv.add_argument("--out", required=True)
    cv.add_argument("--on-bad-row", choices=BAD_ROW_POLICIES, default="raise")
    cv.set_defaults(func=cmd_convert)
    return parser


EXIT_USAGE, EXIT_FAILED = 2, 1  # and 128 + signal (130 Ctrl-C, 143 SIGTERM) for a stopped run: docs/reliability.md


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 2 a usage or configuration error (argparse's own), 1 data that cannot be read, a
    failing server or process, or a bug in deeprec; 130/143 a run stopped by a signal."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: `serve --allocator` re-executes it
    console = make_console(stderr=True)  # a message is one line where stderr is no terminal
    configure_progress(console)  # evaluation, export and synth progress share the CLI's console

    def fail(err: Exception, code: int) -> int:
        console.print(f"[red]error:[/red] {escape(str(err))}", highlight=False, soft_wrap=True)  # one line
        return code

    try:
        return args.func(args, console)
    except (ConfigError, FileNotFoundError) as err:  # usage and configuration: exit code 2, as argparse's
        return fail(err, EXIT_USAGE)
    except DeepRecError as err:  # data that cannot be read, a parameter server that fails
        return fail(err, EXIT_FAILED)
    except Exception:  # not the user's mistake: a traceback, and its first line says whose it is
        console.print("[red]internal error: a bug in deeprec[/red] (please report it with the traceback below)",
                      highlight=False, soft_wrap=True)
        console.print(escape(traceback.format_exc()), highlight=False, soft_wrap=True)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
