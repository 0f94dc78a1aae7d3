import contextlib
import csv
import multiprocessing
import subprocess
import sys
import os

import pytest
import torch

import prefork
from deeprec.cli import sample_path
from deeprec.data import write_synthetic

prefork.install()  # `python -m deeprec ...` started by a test is forked from a preloaded server (tests/prefork.py)
# multiprocessing's forkserver (the stage process; the tests' ranks) imports torch and deeprec once
multiprocessing.set_forkserver_preload(["deeprec.runtime.stage_process"])


def _thread_budget() -> int | None:
    """Under pytest-xdist (-n N) each of the N workers gets its share of the cores, for torch in the
    worker and (OMP_NUM_THREADS, unless set) for the processes its tests start: N workers with all
    the cores each would oversubscribe them N times. None when not under xdist."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if not os.environ.get("PYTEST_XDIST_WORKER") or workers < 1:
        return None
    return max(1, (os.cpu_count() or 1) // workers)


_threads = _thread_budget()
if _threads is not None:
    torch.set_num_threads(_threads)
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):  # numpy's BLAS pool too
        os.environ.setdefault(_var, str(_threads))


@pytest.fixture(scope="session")
def sample() -> str:
    return sample_path()


@pytest.fixture(scope="session")
def sample_rows(sample) -> list[list[str]]:
    """The bundled sample parsed by Python's csv module (header dropped)."""
    with open(sample, newline="") as f:
        return list(csv.reader(f))[1:]


@pytest.fixture(scope="session")
def unique_tsv(tmp_path_factory, sample_rows) -> str:
    """10,000-row headerless TSV whose C1 is a unique row id (hex of the row number)."""
    path = tmp_path_factory.mktemp("data") / "unique.tsv"
    with open(path, "w") as f:
        for k in range(10_000):
            row = list(sample_rows[k % len(sample_rows)])
            row[14] = f"{k:08x}"
            f.write("\t".join(row) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory) -> tuple[str, str]:
    """Small-cardinality synthetic train (80k rows) and eval (10k rows) files."""
    folder = tmp_path_factory.mktemp("synth")
    train, evaluation = str(folder / "train.tsv"), str(folder / "eval.tsv")
    write_synthetic(train, 80_000, cardinalities="small", seed=1)
    write_synthetic(evaluation, 10_000, cardinalities="small", seed=2)
    return train, evaluation


def write_lines(path, lines) -> str:
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
def small_model() -> dict:
    """Overrides that keep DLRM small and fast for tests: hashed tables of 1000 rows (the zoo's default,
    EmbeddingVariables, is what tests with `embedding="variable"` or no override train)."""
    return {"hash_buckets": 1000, "embedding": "table", "bottom_mlp": (32, 16), "top_mlp": (32,)}


os.environ.setdefault("DEEPREC_CACHE", os.path.join(os.path.dirname(__file__), ".cache"))
# `deeprec serve` keeps the process the suite's fork server started (tests/prefork.py) instead of
# re-executing it with mimalloc (a fresh interpreter, 2-3 s a start); tests/test_serving.py tests that
os.environ.setdefault("DEEPREC_SERVE_ALLOCATOR", "system")


@pytest.fixture(scope="session")
def behavior(tmp_path_factory) -> tuple[str, str]:
    """Synthetic behaviour logs (one world): train 30k rows, eval 5k rows."""
    from deeprec.data import write_behavior

    folder = tmp_path_factory.mktemp("behavior")
    train, evaluation = str(folder / "train.tsv"), str(folder / "eval.tsv")
    write_behavior(train, 30_000, seed=5, sample_seed=1)
    write_behavior(evaluation, 5_000, seed=5, sample_seed=2)
    return train, evaluation


def start_ps(shard=0, num_shards=1, threads=2):
    proc = subprocess.Popen([sys.executable, "-m", "deeprec.distributed.ps", "--bind", "127.0.0.1:0",
                             "--shard", str(shard), "--num-shards", str(num_shards), "--threads", str(threads)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # "deeprec PS 0/1 listening on 127.0.0.1:PORT"
    assert "listening on" in line, line
    return proc, line.split()[-1]


@pytest.fixture
def ps_pool():
    procs = []

    def make(n):
        started = [start_ps(i, n) for i in range(n)]
        procs.extend(p for p, _ in started)
        return [a for _, a in started], [p for p, _ in started]

    yield make
    for p in procs:
        p.kill()
        p.wait(10)


@contextlib.contextmanager
def running_ps(*args, env=None, cwd=None):
    """A PS process (`python -m deeprec.distributed.ps ARGS`) for the block: yields (process, its first line)."""
    proc = subprocess.Popen([sys.executable, "-m", "deeprec.distributed.ps", *args], stdout=subprocess.PIPE, text=True,
                            env=env, cwd=cwd)
    try:
        yield proc, proc.stdout.readline()
    finally:
        proc.kill()
        proc.wait(10)


pytest_plugins = ["cluster",  # tests/cluster.py: the `cluster` fixture (hosts in network namespaces)
                  "scheduling"]  # tests/scheduling.py: the work units of `make test`, the longest first


# -- durations in the open ------------------------------------------------------------------------
# CI prints the 25 slowest tests (make test: --durations=25). A test that takes more than SLOW_S
# (its setup, call and teardown together) says why in its marker: @pytest.mark.slow(reason="...").
# One that does not is listed at the end of the run (a warning, not a failure: timings are noisy).
SLOW_S = 60.0
_took: dict[str, float] = {}
_reasons: dict[str, str] = {}


def _note_slow_reasons(items) -> None:
    for item in items:
        marker = item.get_closest_marker("slow")
        if marker is not None and marker.kwargs.get("reason"):
            item.user_properties.append(("slow_reason", marker.kwargs["reason"]))  # travels with xdist's reports


def pytest_runtest_logreport(report):
    _took[report.nodeid] = _took.get(report.nodeid, 0.0) + report.duration
    for key, value in report.user_properties:
        if key == "slow_reason":
            _reasons[report.nodeid] = value


def pytest_terminal_summary(terminalreporter):
    unexplained = sorted(((s, n) for n, s in _took.items() if s > SLOW_S and n not in _reasons), reverse=True)
    if unexplained:
        terminalreporter.write_sep("=", f"tests over {SLOW_S:.0f} s without slow(reason=...)", yellow=True)
        for seconds, nodeid in unexplained:
            terminalreporter.write_line(f"{seconds:7.1f}s {nodeid}")


def pytest_collection_modifyitems(config, items):
    """The longest work units first (tests/scheduling.py: how `make test` hands them to its workers)."""
    from scheduling import sort_longest_first

    _note_slow_reasons(items)
    sort_longest_first(items)
