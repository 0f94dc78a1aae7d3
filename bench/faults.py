"""Failures across hosts (issue 28), measured: every fault of bench/faults_ps.py (parameter servers),
bench/faults_collective.py (collective training) and bench/faults_serving.py (serving), once each, in
network namespaces of this machine (tests/cluster.py: needs root and `ip netns`).

    python bench/faults.py [--only ps,collective,serving] [--workdir DIR]

Writes results/faults.json (machine, CPU model, every fault's row, and the modules skipped with why),
prints a table, and plots results/faults.png: time to detect and to recover per fault. A module that
is missing or fails is skipped and said so; the others still run.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
import traceback

from _common import cpu_line, print_table, save_figure, save_json

MODULES = {"ps": "faults_ps", "collective": "faults_collective", "serving": "faults_serving"}
COLUMNS = ["fault", "detect_s", "recover_s", "requests_failed", "p99_ms_during_fault", "steps_redone", "rows_lost"]


def run(only: list[str], workdir: str) -> tuple[list[dict], dict[str, str]]:
    """(rows: each fault's dict plus its "source" module and "seconds" of its module's run, skipped: {module: why})."""
    rows, skipped = [], {}
    for key in only:
        name = MODULES[key]
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:  # the module is there but something it imports is not
                skipped[name] = f"import failed: {err}"
            else:
                skipped[name] = f"bench/{name}.py is missing"
            print(f"skipped {name}: {skipped[name]}", flush=True)
            continue
        except Exception as err:
            skipped[name] = f"import failed: {type(err).__name__}: {err}"
            print(f"skipped {name}: {skipped[name]}", flush=True)
            continue
        folder = os.path.join(workdir, key)
        os.makedirs(folder, exist_ok=True)
        print(f"running {name}.measure ...", flush=True)
        started = time.perf_counter()
        try:
            measured = module.measure(folder)
        except Exception as err:
            skipped[name] = f"failed: {type(err).__name__}: {err}"
            print(f"skipped {name}: {skipped[name]}\n{traceback.format_exc()}", flush=True)
            continue
        seconds = round(time.perf_counter() - started, 1)
        rows.extend({**row, "source": name, "module_seconds": seconds} for row in measured)
    return rows, skipped


def _cell(value) -> str:
    return "-" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["fault"] for r in rows]
    detect = [r.get("detect_s") or 0.0 for r in rows]
    recover = [r.get("recover_s") or 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], detect, 0.4, label="detect (s)")
    ax.bar([x + 0.2 for x in xs], recover, 0.4, label="recover (s)")
    for x, r in zip(xs, rows):
        if r.get("detect_s") is None:
            ax.text(x - 0.2, 0, "n/a", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title(f"Failures across hosts: time to detect / recover\n{cpu_line()}", fontsize=9)
    ax.legend()
    save_figure(fig, "faults")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(MODULES), help="comma-separated: ps, collective, serving")
    parser.add_argument("--workdir", default=None, help="where the clusters' files go (default: a temporary folder)")
    args = parser.parse_args()
    only = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = [k for k in only if k not in MODULES]
    if unknown:
        parser.error(f"--only: unknown {', '.join(unknown)} (choose from {', '.join(MODULES)})")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="deeprec-faults-") as tmp:
        rows, skipped = run(only, args.workdir or tmp)
    path = save_json("faults", {"faults": rows, "skipped": skipped, "modules": [MODULES[k] for k in only]})
    print_table(f"Failures across hosts ({cpu_line()})", COLUMNS,
                [[_cell(r.get(c)) for c in COLUMNS] for r in rows])
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    if rows:
        plot(rows)
    print("saved", path)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
