"""`deeprec` command line: train, launch, explain, evaluate, data synth, data convert."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from importlib import resources

from rich.console import Console
from rich.table import Table

from deeprec.errors import DeepRecError
from deeprec.models import MODELS
from deeprec.optim import OPTIMIZERS

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

    cache = os.environ.get("DEEPREC_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "deeprec"))
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


def cmd_train(args, console: Console) -> int:
    from deeprec.trainer import TrainConfig, train

    data, eval_data, note = args.data, args.eval_data, None
    if args.synthetic:
        if data:
            raise DeepRecError("give --data or --synthetic, not both")
        kind = "behavior" if args.model in MODEL_SAMPLES else "criteo"
        train_file, eval_file = synthetic_files(args.synthetic, args.cardinalities, args.seed, console, kind)
        data, eval_data = [train_file], eval_data or [eval_file]
    elif not data:
        sample = MODEL_SAMPLES.get(args.model, SAMPLE)
        data = [sample_path(sample)]
        note = (f"smoke run on the bundled {SAMPLE_NAMES[sample]}, 20% of it held out for eval: "
                "the AUC is noise; try --synthetic 1000000 for a meaningful run")
    eval_fraction = args.eval_fraction if args.eval_fraction is not None else (0.2 if note else 0.0)
    ps = {}
    if os.environ.get("TF_CONFIG"):  # a worker of a parameter-server job (deeprec launch, Kubeflow TFJob)
        from deeprec.distributed import parse_tf_config, read_endpoint_map

        task = parse_tf_config()
        if task.job_name not in ("worker", "chief"):
            raise DeepRecError(f"`deeprec train` runs worker tasks; TF_CONFIG says {task.job_name!r} "
                               "(start PS tasks with `python -m deeprec.distributed`)")
        endpoints = read_endpoint_map()
        ps = dict(ps_addresses=[endpoints.get(a, a) for a in task.cluster.job_tasks("ps")],
                  shard_index=task.task_index, num_shards=task.cluster.num_tasks("worker"),
                  is_chief=task.task_index == 0, protocol=os.environ.get("DEEPREC_PROTOCOL", args.protocol),
                  sync=args.sync, async_embedding=args.async_embedding)
        eval_fraction = 0.0 if ps["num_shards"] > 1 else eval_fraction
    elif args.async_embedding:
        raise DeepRecError("--async-embedding applies to parameter-server workers (deeprec launch ... -- train)")
    cfg = TrainConfig(model=args.model, data=data, eval_data=eval_data or [], eval_fraction=eval_fraction,
                      steps=args.steps, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                      optimizer=args.optimizer, shuffle_buffer=args.shuffle_buffer, seed=args.seed,
                      on_bad_row=args.on_bad_row, checkpoint_dir=args.checkpoint_dir,
                      checkpoint_every=args.checkpoint_every, incremental_every=args.incremental_every,
                      resume=args.resume, threads=args.threads,
                      smart_stage=args.smart_stage, capacity=args.capacity, stage_threads=args.stage_threads,
                      stage_executor=args.stage_executor, embedding=args.embedding,
                      multi_stream=args.multi_stream, stream_policy=args.stream_policy, micro_batch=args.micro_batch,
                      compile=args.compile, bf16={"on": True, "off": False}.get(args.bf16, args.bf16),
                      malloc_tuning=args.malloc_tuning, schema=args.schema, **ps)
    if note:
        console.print(f"[bold]{note}[/bold]")
    result = train(cfg, console)
    table = Table(title=f"deeprec train --model {args.model}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("steps", str(result["steps"]))
    table.add_row("samples/s", f"{result['samples_per_s']:,.0f}")
    table.add_row("final train loss", f"{result['final_loss']:.4f}")
    if "auto" in result:
        table.add_row("smart stage auto", result["auto"])
    if "bf16" in result:
        table.add_row("bf16 auto", result["bf16"])
    if "malloc" in result:
        table.add_row("memory", result["malloc"])
    if "stage" in result:
        st = result["stage"]
        table.add_row("smart stage", f"{st['taken']} batches staged ahead, {st['dropped']} dropped, "
                                     f"{st['ignored']} ignored")
    if result["bad_rows"]:
        table.add_row("bad rows skipped", str(result["bad_rows"]))
    if "eval" in result:
        ev = result["eval"]
        table.add_row("eval rows", f"{ev['rows']:,}")
        for name, metrics in (ev.get("tasks") or {"": ev}).items():
            suffix = f" ({name})" if name else ""
            table.add_row(f"eval AUC{suffix}", f"{metrics['auc']:.4f}")
            table.add_row(f"eval logloss{suffix}", f"{metrics['logloss']:.4f}")
    Console().print(table)
    if note:
        console.print(note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def cmd_launch(args, console: Console) -> int:
    from deeprec.distributed.launch import launch

    train_args = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    return launch(args.ps, args.workers, args.protocol, train_args, sync=args.sync, resume=args.resume)


def cmd_explain(args, console: Console) -> int:
    import deeprec as dr
    from deeprec.models import build_model

    fast = dr.optimize(build_model(args.model), dr.Config(smart_stage=not args.no_smart_stage))
    print(fast.explain())
    return 0


def cmd_evaluate(args, console: Console) -> int:
    from deeprec.checkpoint import latest_checkpoint, load_checkpoint, load_model_weights
    from deeprec.data import open_reader
    from deeprec.models import build_model
    from deeprec.trainer import evaluate

    path = args.checkpoint if os.path.isfile(args.checkpoint) else latest_checkpoint(args.checkpoint)
    if path is None:
        raise DeepRecError(f"no checkpoint found in {args.checkpoint}")
    from deeprec.data import schema_from_dict

    state = load_checkpoint(path)
    schema = schema_from_dict(state["schema"]) if state.get("schema") else None
    model = build_model(state["model_name"], schema=schema, **state["model_overrides"])
    load_model_weights(model, state["model"])
    metrics = evaluate(model, open_reader(args.data, args.batch_size, schema=schema, on_bad_row=args.on_bad_row))
    console.print(f"{path} (step {state['step']}) on {', '.join(args.data)}")
    print(json.dumps(metrics))
    return 0


def cmd_synth(args, console: Console) -> int:
    from deeprec.data import write_behavior, write_synthetic

    if args.kind == "behavior":
        summary = write_behavior(args.out, args.rows, seed=args.seed)
    else:
        summary = write_synthetic(args.out, args.rows, cardinalities=args.cardinalities, seed=args.seed)
    print(json.dumps(summary))
    return 0


def cmd_convert(args, console: Console) -> int:
    from deeprec.data import CriteoReader, write_parquet

    rows = write_parquet(CriteoReader(args.input, 65536, on_bad_row=args.on_bad_row), args.out)
    print(json.dumps({"rows": rows, "out": args.out}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deeprec", description="Fast training of sparse CTR models.")
    sub = parser.add_subparsers(dest="command", required=True)

    tr = sub.add_parser("train", help="train a model")
    tr.add_argument("--model", choices=sorted(MODELS), default="dlrm")
    tr.add_argument("--data", nargs="+", help="TSV/CSV/Parquet files, folders or globs (default: bundled sample)")
    tr.add_argument("--eval-data", nargs="+")
    tr.add_argument("--schema", help="the data's columns: a preset (criteo, avazu, movielens, byterec, behavior) "
                                     "or a TOML schema file (default: the preset the data matches)")
    tr.add_argument("--eval-fraction", type=float, help="hold out this share of --data for eval")
    span = tr.add_mutually_exclusive_group()
    span.add_argument("--steps", type=int)
    span.add_argument("--epochs", type=int)
    tr.add_argument("--batch-size", type=int, default=512)
    tr.add_argument("--lr", type=float, default=0.001)
    tr.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    tr.add_argument("--shuffle-buffer", type=int, default=0)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--on-bad-row", choices=("raise", "skip"), default="raise")
    tr.add_argument("--checkpoint-dir")
    tr.add_argument("--checkpoint-every", type=int, default=0)
    tr.add_argument("--incremental-every", type=int, default=0,
                    help="steps between incremental checkpoints (EmbeddingVariable rows touched since the last full one)")
    tr.add_argument("--resume", action="store_true")
    tr.add_argument("--synthetic", type=int, metavar="ROWS", help="train on ROWS synthetic rows (cached)")
    tr.add_argument("--cardinalities", "--synthetic-cardinalities", choices=("kaggle", "small"), default="kaggle")
    tr.add_argument("--embedding", choices=("table", "variable", "torch"),
                    help="fused hashed tables (default), EmbeddingVariables (no buckets), or nn.Embedding")
    tr.add_argument("--threads", type=int, help="torch intra-op threads")
    tr.add_argument("--json", help="write the result as JSON here")
    tr.add_argument("--smart-stage", action="store_true", help="run the data-side subgraph ahead in background")
    tr.add_argument("--capacity", type=int, default=1, help="SmartStage: batches buffered ahead")
    tr.add_argument("--stage-threads", type=int, default=1, help="SmartStage: runner threads")
    tr.add_argument("--stage-executor", choices=("auto", "thread", "process"), default="auto",
                    help="SmartStage: auto (measure the first batches, then pick off, thread or process and the "
                         "step's threads), threads, or a worker process (no GIL sharing)")
    tr.set_defaults(func=cmd_train)

    tr.add_argument("--protocol", choices=("grpc", "star_server", "star_server_lite"), default="star_server",
                    help="parameter-server protocol when run as a PS worker (TF_CONFIG set)")
    tr.add_argument("--sync", action="store_true", help="PS worker: average all workers' gradients per step")
    tr.add_argument("--multi-stream", type=int, default=1, metavar="N",
                    help="run independent branches of the step on N streams (CUDA) / threads (CPU)")
    tr.add_argument("--stream-policy", choices=("user", "embedding", "full"), default="embedding",
                    help="how nodes get streams: dr.stream markers, one per embedding branch, or minimum chains")
    tr.add_argument("--micro-batch", type=int, default=1, metavar="N",
                    help="split each batch into N micro-batches, accumulate, one optimizer step")
    tr.add_argument("--compile", action="store_true", help="torch.compile the training step (graph fusion)")
    tr.add_argument("--malloc-tuning", action="store_true",
                    help="glibc mallopt: keep freed memory mapped (halves page faults per step; +3.5%% measured)")
    tr.add_argument("--bf16", nargs="?", const="on", default="off", choices=("on", "off", "auto"),
                    help="run the step under autocast(bfloat16), fp32 weights; auto: only where the hardware has "
                         "fast bf16 (CUDA, AMX or AVX512-BF16 CPUs)")
    tr.add_argument("--async-embedding", action="store_true",
                    help="PS worker with --smart-stage: pull batch t+1's embedding rows while batch t computes")

    la = sub.add_parser("launch", help="run a parameter-server job on this machine")
    la.add_argument("--ps", type=int, default=1)
    la.add_argument("--workers", type=int, default=1)
    la.add_argument("--protocol", choices=("grpc", "star_server", "star_server_lite"), default="star_server")
    la.add_argument("--sync", action="store_true", help="average all workers' gradients per step")
    la.add_argument("--resume", action="store_true", help="continue from the workers' --checkpoint-dir")
    la.add_argument("rest", nargs=argparse.REMAINDER, help="-- train ... (the worker command)")
    la.set_defaults(func=cmd_launch)

    ex = sub.add_parser("explain", help="show how deeprec.optimize partitions a model")
    ex.add_argument("--model", choices=sorted(MODELS), default="dlrm")
    ex.add_argument("--no-smart-stage", action="store_true")
    ex.set_defaults(func=cmd_explain)

    ev = sub.add_parser("evaluate", help="AUC and log loss of a checkpoint on data")
    ev.add_argument("--checkpoint", required=True, help="checkpoint file or folder (latest is used)")
    ev.add_argument("--data", nargs="+", required=True)
    ev.add_argument("--batch-size", type=int, default=4096)
    ev.add_argument("--on-bad-row", choices=("raise", "skip"), default="raise")
    ev.set_defaults(func=cmd_evaluate)

    data = sub.add_parser("data", help="data tools").add_subparsers(dest="data_command", required=True)
    sy = data.add_parser("synth", help="write synthetic Criteo-layout TSV")
    sy.add_argument("--rows", type=int, required=True)
    sy.add_argument("--out", required=True)
    sy.add_argument("--kind", choices=("criteo", "behavior"), default="criteo",
                    help="Criteo layout, or behaviour sequences (DIN, DIEN, DSSM, MMoE)")
    sy.add_argument("--cardinalities", choices=("kaggle", "small"), default="kaggle")
    sy.add_argument("--seed", type=int, default=0)
    sy.set_defaults(func=cmd_synth)
    cv = data.add_parser("convert", help="Criteo TSV/CSV to Parquet")
    cv.add_argument("input", nargs="+")
    cv.add_argument("--out", required=True)
    cv.add_argument("--on-bad-row", choices=("raise", "skip"), default="raise")
    cv.set_defaults(func=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    console = Console(stderr=True)
    try:
        return args.func(args, console)
    except (DeepRecError, FileNotFoundError) as err:
        console.print(f"[red]error:[/red] {err}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
