"""deeprec serve under load: latency at batch 1 and 256, throughput with 8 concurrent clients, and
the time to apply an online delta of 100k EmbeddingVariable rows (in process).

A DLRM with EmbeddingVariables, trained briefly on the bundled Criteo sample, is exported and
served by `deeprec serve` in its own process; this process is the client (httpx), on loopback.
Each request carries real rows as JSON columns. Request loops are bounded (--requests).
On this 2-core machine server and client share the cores: the numbers include that contention.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from _common import cpu_line, print_table, save_figure, save_json

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def exported_model(folder: str) -> tuple[str, dict]:
    import deeprec as dr
    from deeprec.cli import sample_path
    from deeprec.trainer import TrainConfig, Trainer
    from test_serving import _json_rows

    data = sample_path("criteo_sample.txt")
    trainer = Trainer(TrainConfig.create(model="dlrm", data=[data], steps=5, batch_size=64, embedding="variable",
                                         progress=False))
    trainer.train()
    path = dr.export(trainer.model, os.path.join(folder, "export"), schema=trainer.schema, model_name="dlrm", step=5)
    return path, _json_rows(data, trainer.schema, 200)


def rows_of(rows: dict, n: int, start: int = 0) -> dict:
    """n rows (cycling over the sample's 200)."""
    picks = [(start + i) % 200 for i in range(n)]
    return {k: [v[i] for i in picks] for k, v in rows.items()}


def latency(url: str, rows: dict, batch: int, requests: int) -> dict:
    body = {"inputs": rows_of(rows, batch)}
    times = []
    with httpx.Client(timeout=60) as client:
        for _ in range(10):  # warm-up
            client.post(f"{url}/v1/predict", json=body).raise_for_status()
        for _ in range(requests):
            start = time.perf_counter()
            client.post(f"{url}/v1/predict", json=body).raise_for_status()
            times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return {"p50_ms": statistics.median(times), "p99_ms": times[min(len(times) - 1, int(0.99 * len(times)))],
            "requests": requests}


async def throughput(url: str, rows: dict, batch: int, clients: int, requests: int) -> dict:
    bodies = [{"inputs": rows_of(rows, batch, start=17 * i)} for i in range(clients)]

    async def client_loop(i: int, client: httpx.AsyncClient) -> None:
        for _ in range(requests // clients):
            (await client.post(f"{url}/v1/predict", json=bodies[i])).raise_for_status()

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(client_loop(i, client) for i in range(clients)))  # warm-up pass
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(i, client) for i in range(clients)))
        elapsed = time.perf_counter() - start
    done = (requests // clients) * clients
    return {"rows_per_s": done * batch / elapsed, "requests_per_s": done / elapsed, "clients": clients,
            "batch": batch, "requests": done}


def delta_apply_seconds(path: str, rows: int = 100_000, repeats: int = 3) -> dict:
    """Time to apply a delta of `rows` EmbeddingVariable rows (new keys) plus the dense weights."""
    import torch
    from safetensors.torch import save_file

    import deeprec as dr
    from deeprec.atomic import write_with_manifest
    from deeprec.serving.export import FORMAT
    from deeprec.serving.online import apply_delta

    served = dr.serving.load(path)
    variables = sorted({k.rsplit(".", 1)[0] for k in served.module.state_dict() if k.endswith(".sorted_keys")})
    g = torch.Generator().manual_seed(0)
    per = rows // len(variables)
    tensors = {}
    for name in variables:
        tensors[f"{name}.keys"] = torch.randint(0, 1 << 62, (per,), generator=g)
        tensors[f"{name}.values"] = torch.randn(per, served.module.get_submodule(name).values.shape[1], generator=g)
    tensors.update({k: v.clone() for k, v in served.module.state_dict().items()
                    if not k.endswith((".sorted_keys", ".values", ".missing_value"))})
    folder = os.path.dirname(path)
    write_with_manifest(os.path.join(folder, "delta.safetensors"), os.path.join(folder, "delta.json"),
                        lambda tmp: save_file(tensors, tmp),
                        {"format": FORMAT, "step": served.step + 1, "after": served.step, "variables": variables})
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        apply_delta(served, os.path.join(folder, "delta.json"))
        times.append(time.perf_counter() - start)
    return {"rows": per * len(variables), "variables": len(variables), "seconds": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--max-wait-ms", type=float, default=2.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path, rows = exported_model(folder)
        server = subprocess.Popen([sys.executable, "-m", "deeprec", "serve", path, "--port", "0",
                                   "--max-wait-ms", str(args.max_wait_ms)], stdout=subprocess.PIPE, text=True)
        try:
            url = server.stdout.readline().split()[-1]
            results = {"latency_batch1": latency(url, rows, 1, args.requests),
                       "latency_batch256": latency(url, rows, 256, max(50, args.requests // 4)),
                       "throughput_8_clients_batch1": asyncio.run(throughput(url, rows, 1, 8, args.requests)),
                       "throughput_8_clients_batch64": asyncio.run(throughput(url, rows, 64, 8, args.requests)),
                       "metrics": httpx.get(f"{url}/metrics").text}
        finally:
            server.terminate()
            server.wait(30)
        results["delta_apply"] = delta_apply_seconds(path)
    batch_rows = [l for l in results["metrics"].splitlines() if l.startswith("deeprec_batch_rows_")
                  and not l.startswith("deeprec_batch_rows_bucket")]
    table = [["latency, batch 1", f"{results['latency_batch1']['p50_ms']:.2f}", f"{results['latency_batch1']['p99_ms']:.2f}", ""],
             ["latency, batch 256", f"{results['latency_batch256']['p50_ms']:.2f}",
              f"{results['latency_batch256']['p99_ms']:.2f}", ""],
             ["8 clients, 1 row each", "", "", f"{results['throughput_8_clients_batch1']['rows_per_s']:,.0f}"],
             ["8 clients, 64 rows each", "", "", f"{results['throughput_8_clients_batch64']['rows_per_s']:,.0f}"],
             [f"apply a delta of {results['delta_apply']['rows']:,} rows ({results['delta_apply']['variables']} EVs)",
              f"{results['delta_apply']['seconds'] * 1e3:.0f}", "", ""]]
    print_table(f"deeprec serve, DLRM (EmbeddingVariables), loopback, client in a second process - {cpu_line()}",
                ["load", "p50 ms", "p99 ms", "rows/s"], table)
    print("\n".join(batch_rows))
    results.pop("metrics")
    print("saved", save_json("serving", {"requests": args.requests, "max_wait_ms": args.max_wait_ms, **results}))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    names = ["batch 1", "batch 256"]
    left.bar([0, 1], [results["latency_batch1"]["p50_ms"], results["latency_batch256"]["p50_ms"]], 0.4, label="p50")
    left.bar([0.4, 1.4], [results["latency_batch1"]["p99_ms"], results["latency_batch256"]["p99_ms"]], 0.4,
             label="p99")
    left.set_xticks([0.2, 1.2], names)
    left.set_ylabel("ms per request")
    left.legend()
    right.bar([0, 1], [results["throughput_8_clients_batch1"]["rows_per_s"],
                       results["throughput_8_clients_batch64"]["rows_per_s"]], color="tab:green")
    right.set_xticks([0, 1], ["8 clients x 1 row", "8 clients x 64 rows"])
    right.set_ylabel("rows/s")
    save_figure(fig, "serving")


if __name__ == "__main__":
    main()
