"""Helpers shared by the benchmarks: machine info, statistics, JSON, table, plot."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine() -> dict:
    from deeprec.runtime.hardware import cpu_info

    info = cpu_info()
    simd = sorted(f for f in info["flags"] if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))
    return {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "cpu_model": info["model"],
            "torch_cpu_capability": info["torch_capability"], "cpu_simd_flags": simd,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def cpu_line() -> str:
    """One line naming this machine's CPU, for table titles."""
    m = machine()
    bf16 = "bf16" if any("bf16" in f for f in m["cpu_simd_flags"]) else "no bf16"
    return f"{m['cpu_model']}, {m['cpus']} cores, torch {m['torch_cpu_capability']}, {bf16}"


def summarize(samples: list[float]) -> dict:
    """Median, mean and spread (10th-90th percentile) of repeated measurements."""
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]  # noqa: E731
    return {"median": statistics.median(ordered), "mean": statistics.fmean(ordered),
            "p10": pick(0.1), "p90": pick(0.9), "n": len(ordered)}


def save_json(name: str, payload: dict) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"machine": machine(), **payload}, f, indent=2)
    return path


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[str(v) for v in row])
    Console(width=160).print(table)


def plot_path(name: str) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    return os.path.join(RESULTS, f"{name}.png")


def _written_once(name: str, write) -> str:
    """results/<name>, made by write(tmp_path) the first time it is asked for."""
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        os.makedirs(RESULTS, exist_ok=True)
        write(path + ".tmp")
        os.replace(path + ".tmp", path)
    return path


def synthetic_criteo(rows: int, cardinalities: str = "kaggle") -> str:
    """Synthetic Criteo TSV (seed 0), written once into results/."""
    from deeprec.data import write_synthetic

    return _written_once(f"synth-{cardinalities}-{rows}.tsv",
                         lambda tmp: write_synthetic(tmp, rows, cardinalities=cardinalities, seed=0))


def synthetic_behavior(rows: int) -> str:
    """Synthetic behaviour logs (seed 0), written once into results/."""
    from deeprec.data import write_behavior

    return _written_once(f"synth-behavior-{rows}.tsv", lambda tmp: write_behavior(tmp, rows, seed=0))


def save_figure(fig, name: str) -> None:
    """Lay out, write results/<name>.png, and say where."""
    fig.tight_layout()
    fig.savefig(plot_path(name))
    print("saved", plot_path(name))
