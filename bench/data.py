"""Data where it lives (issue #27): the same Criteo-layout rows read, and DLRM trained, from a local
TSV, the TSV in S3 (moto's server on loopback, real HTTP through s3fs), gzip-compressed, as ORC and as
Parquet. Rounds alternate the sources; medians and ratios to the local TSV.

    reader rows/s     open_reader(source, 4096) over every row
    training          deeprec's Trainer, DLRM, batch 512, Adagrad, SmartStage auto: steady samples/s
                      (after 50 warm-up and calibration steps), as bench/e2e.py

Targets: S3 reader >= 0.8x local (ranged reads with read-ahead); .gz training >= 0.9x uncompressed.

    python bench/data.py [--rows 300000] [--rounds 3] [--steps 250]
"""
from __future__ import annotations

import argparse
import gzip
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_line, plot_path, print_table, save_json, summarize, synthetic_criteo  # noqa: E402

BUCKET = "deeprec-bench"


class LoopbackS3:
    """moto's S3 server on a free loopback port (no authentication: any key works), and the
    environment s3fs reads its endpoint and credentials from."""

    def __enter__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        server = os.path.join(os.path.dirname(sys.executable), "moto_server")
        if not os.path.exists(server):
            raise SystemExit("moto_server is not installed: pip install 'moto[server]' (make setup does)")
        self.home = tempfile.mkdtemp(prefix="moto-")
        self.proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(self.port)], cwd=self.home,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start")
                time.sleep(0.1)
        self.url = f"http://127.0.0.1:{self.port}"
        os.environ.update(AWS_ENDPOINT_URL=self.url, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                          AWS_DEFAULT_REGION="us-east-1")
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.url, region_name="us-east-1")
        self.client.create_bucket(Bucket=BUCKET)
        return self

    def put(self, path: str, key: str) -> str:
        self.client.upload_file(path, BUCKET, key)
        return f"s3://{BUCKET}/{key}"

    def ceiling(self, key: str, block: int = 4 << 20) -> float:
        """Seconds the server takes to hand over the whole object in ranged GETs of `block` bytes,
        one after another, read by boto3 into memory: what no reader of it can beat."""
        size = self.client.head_object(Bucket=BUCKET, Key=key)["ContentLength"]
        started = time.perf_counter()
        for start in range(0, size, block):
            self.client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={start}-{start + block - 1}")["Body"].read()
        return time.perf_counter() - started

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.home, ignore_errors=True)


def make_sources(rows: int, folder: str, s3: LoopbackS3) -> dict[str, str]:
    from deeprec.data import open_reader, write_parquet

    tsv = synthetic_criteo(rows)
    gz = os.path.join(folder, "day.tsv.gz")
    with open(tsv, "rb") as src, gzip.open(gz, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    orc, parquet = os.path.join(folder, "day.orc"), os.path.join(folder, "day.parquet")
    subprocess.run([sys.executable, "-m", "deeprec.cli", "data", "convert", tsv, "--out", orc], check=True,
                   capture_output=True)
    write_parquet(open_reader([tsv], 65536, num_epochs=1), parquet)
    return {"local tsv": tsv, "s3 tsv": s3.put(tsv, "day.tsv"), "local tsv.gz": gz, "s3 tsv.gz": s3.put(gz, "day.tsv.gz"),
            "local orc": orc, "local parquet": parquet}


def reader_rate(source: str) -> tuple[float, int]:
    from deeprec.data import open_reader

    started, rows = time.perf_counter(), 0
    for batch in open_reader([source], 4096, num_epochs=1):
        rows += len(batch["label"])
    return rows / (time.perf_counter() - started), rows


TRAIN = """
import json, sys
from deeprec.trainer import TrainConfig, Trainer
cfg = TrainConfig.create(model="dlrm", data=[sys.argv[1]], steps=int(sys.argv[2]), optimizer="adagrad", lr=0.01,
                         batch_size=512, progress=False, seed=0)  # bench/e2e.py's configuration
print(json.dumps(Trainer(cfg).train()["steady_samples_per_s"]))  # after 50 warm-up / calibration steps
"""


def train_rate(source: str, steps: int) -> float:
    """In a fresh process each: Kaggle-size tables (4 GB with Adagrad's) and the reader's threads of
    one measurement never weigh on the next."""
    done = subprocess.run([sys.executable, "-c", TRAIN, source, str(steps)], capture_output=True, text=True,
                          env=os.environ, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=250, help="training steps per source per round (50 warm-up)")
    args = parser.parse_args()

    import torch

    folder = tempfile.mkdtemp(prefix="bench-data-")
    with LoopbackS3() as s3:
        sources = make_sources(args.rows, folder, s3)
        sizes = {name: os.path.getsize(path) for name, path in sources.items() if "://" not in path}
        reader_rate(sources["s3 tsv"])  # s3fs builds its client once per process (~0.5 s): not timed
        reads: dict[str, list] = {name: [] for name in sources}
        ceilings: list[float] = []
        trains: dict[str, list] = {name: [] for name in ("local tsv", "s3 tsv", "local tsv.gz", "local orc")}
        counted = {}
        for k in range(args.rounds):
            order = list(sources) if k % 2 == 0 else list(reversed(sources))  # alternate: drift hits all alike
            for name in order:
                rate, counted[name] = reader_rate(sources[name])
                reads[name].append(rate)
            ceilings.append(s3.ceiling("day.tsv"))
            for name in (trains if k % 2 == 0 else list(reversed(trains))):
                torch.manual_seed(0)
                trains[name].append(train_rate(sources[name], args.steps))
            print(f"round {k + 1}/{args.rounds} done", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    assert len(set(counted.values())) == 1, f"sources disagree on the rows: {counted}"

    read = {name: summarize(v) for name, v in reads.items()}
    ceiling = summarize([counted["local tsv"] / s for s in ceilings])  # rows/s if parsing were free
    train = {name: summarize(v) for name, v in trains.items()}
    base_read, base_train = read["local tsv"]["median"], train["local tsv"]["median"]
    rows = []
    for name in sources:
        line = [name, f"{sizes.get(name, sizes.get(name.replace('s3', 'local'), 0)) / 1e6:,.1f}",
                f"{read[name]['median']:,.0f}", f"{read[name]['median'] / base_read:.2f}x"]
        if name in train:
            line += [f"{train[name]['median']:,.0f}", f"{train[name]['median'] / base_train:.2f}x"]
        else:
            line += ["", ""]
        rows.append(line)
    title = f"data sources, {counted['local tsv']:,} rows, medians of {args.rounds} rounds ({cpu_line()})"
    print_table(title, ["source", "MB", "reader rows/s", "vs local", "DLRM train samples/s", "vs local"], rows)
    print(f"the S3 server's own ceiling: {ceiling['median']:,.0f} rows/s (ranged GETs of 4 MB, one after another, "
          f"nothing parsed); the S3 reader reaches {read['s3 tsv']['median'] / ceiling['median']:.2f}x of it")
    targets = {"s3 reader >= 0.8x local": read["s3 tsv"]["median"] / base_read,
               ".gz training >= 0.9x uncompressed": train["local tsv.gz"]["median"] / base_train}
    for what, ratio in targets.items():
        print(f"{what}: {ratio:.2f}x ({'met' if ratio >= float(what.split('>= ')[1][:3]) else 'missed'})")
    save_json("data", {"args": vars(args), "rows": counted["local tsv"], "reader_rows_per_s": read,
                       "train_samples_per_s": train, "bytes": sizes, "targets": targets,
                       "s3_server_ceiling_rows_per_s": ceiling,
                       "method": "rounds alternate the sources; S3 is moto_server on loopback (real HTTP via s3fs), "
                                 "sharing the machine's cores with the reader"})
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].barh(list(read), [read[n]["median"] for n in read])
    axes[0].set_xlabel("reader rows/s")
    axes[1].barh(list(train), [train[n]["median"] for n in train])
    axes[1].set_xlabel("DLRM training samples/s")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(plot_path("data"), dpi=110)


if __name__ == "__main__":
    main()
