"""Hybrid training: embeddings on a real PS process, dense layers replicated on two worker
processes and averaged by torch.distributed (gloo) all-reduce."""
import multiprocessing
import os
import re
import socket

import pytest
import torch

from deeprec.distributed.allreduce import rendezvous_from_env
from deeprec.errors import ConfigError

from conftest import running_ps  # noqa: E402
from output import line_with

SMALL = {"hash_buckets": 1000, "bottom_mlp": (32, 16), "top_mlp": (32,), "embedding": "variable"}
STEPS, BATCH, LR = 6, 64, 0.05


def batches(path: str, rank: int | None):
    """STEPS batches of 2 x BATCH rows; a worker takes its half of each."""
    from deeprec.data import open_reader, resolve_schema
    from deeprec.runtime.micro_batch import split_batch

    reader = open_reader([path], 2 * BATCH, schema=resolve_schema([path], None), num_epochs=1)
    out = []
    for batch in reader:
        out.append(batch if rank is None else split_batch(batch, 2)[rank])
        if len(out) == STEPS:
            return out
    raise AssertionError("not enough rows")


def model():
    from deeprec.models import build_model

    torch.manual_seed(3)
    return build_model("dlrm", **SMALL)


def hybrid_worker(rank: int, ps: str, port: int, path: str, results) -> None:
    from deeprec.config import Config
    from deeprec.distributed import PSClient
    from deeprec.distributed.ps.worker import PSUpdater
    from deeprec.runtime import optimize

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    net = model()
    updater = PSUpdater(net, PSClient([ps], deadline_s=60), "adagrad", LR, sync_workers=2, worker_index=rank,
                        num_workers=2, dense="allreduce")
    for _ in optimize(net, Config()).train_steps(batches(path, rank), updater):
        pass
    updater.finish()
    results.put((rank, {n: p.detach().numpy().copy() for n, p in updater.dense.items()}))  # numpy: no fd sharing


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_hybrid_sync_two_workers_equal_one_process_on_the_concatenated_batches(unique_tsv):
    from deeprec.config import Config
    from deeprec.distributed import PSClient
    from deeprec.runtime import optimize
    from deeprec.optim import make_optimizer
    from deeprec.runtime.updater import LocalUpdater

    reference = model()
    local = LocalUpdater(reference, make_optimizer(reference, "adagrad", LR))
    for _ in optimize(reference, Config()).train_steps(batches(unique_tsv, None), local):
        pass
    with running_ps("--bind", "127.0.0.1:0", "--workers", "2") as (_, line):
        address = line.split()[-1]
        ctx = multiprocessing.get_context("forkserver")  # forked from a server that imported torch (conftest)
        results = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=hybrid_worker, args=(rank, address, port, unique_tsv, results))
                 for rank in range(2)]
        for p in procs:
            p.start()
        replicas = {rank: {n: torch.from_numpy(v) for n, v in values.items()}
                    for rank, values in (results.get(timeout=240) for _ in procs)}
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        # floating-point sums in another order (two halves, then all-reduce): 1e-5
        dense = {n: p for n, p in reference.named_parameters() if p.requires_grad}
        for name, value in dense.items():
            assert torch.equal(replicas[0][name], replicas[1][name]), name  # the replicas stay identical
            assert torch.allclose(replicas[0][name], value, atol=1e-5), name
        client = PSClient([address], deadline_s=20)
        client.dims = {f"embeddings.collection.C{f + 1}": 16 for f in range(26)}
        checked = 0
        for f, ev in enumerate(reference.embeddings.collection.lookup.variables):
            keys = ev.keys[: ev.size]
            name = f"embeddings.collection.C{f + 1}"
            pulled = client.pull({name: keys}, train=False)[name]
            assert torch.allclose(pulled, ev.weight[: ev.size], atol=1e-5), name
            checked += keys.numel()
        assert checked > 100
        client.close()


def test_rendezvous_comes_from_the_environment_or_tf_config(monkeypatch):
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert rendezvous_from_env(1, 3, master="w-0:2222").master_addr == "w-0"
    with pytest.raises(ConfigError, match="needs a rendezvous"):
        rendezvous_from_env(1, 3)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    with pytest.raises(ConfigError, match="set but not MASTER_PORT, RANK, WORLD_SIZE"):
        rendezvous_from_env(1, 3)
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="disagree with the PS job"):
        rendezvous_from_env(1, 3)
    monkeypatch.setenv("RANK", "1")
    r = rendezvous_from_env(1, 3)
    assert (r.master_addr, r.master_port, r.rank, r.world_size) == ("10.0.0.1", 29500, 1, 3)


def test_a_pytorch_job_worker_finds_its_ps_in_the_environment(monkeypatch):
    from deeprec.distributed import worker_task_from_env

    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("DEEPREC_PS_ADDRESSES", "ps-0:2222, ps-1:2222")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    task = worker_task_from_env()
    assert task.ps_addresses == ["ps-0:2222", "ps-1:2222"] and (task.index, task.num_workers) == (1, 2)
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ConfigError, match=r"RANK=2 is not in \[0, WORLD_SIZE=2\)"):
        worker_task_from_env()


@pytest.mark.slow
def test_launch_trains_hybrid_with_uneven_worker_data(tmp_path):
    """Workers whose shards end at different steps: the finished one keeps joining the
    all-reduce until the other ends, so neither waits forever."""
    from test_distributed import run_launch

    done = run_launch(["--ps", "1", "--workers", "2", "--", "train", "--model", "dlrm", "--synthetic", "3001",
                       "--cardinalities", "small", "--epochs", "1", "--batch-size", "100", "--dense", "allreduce"],
                      tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2/2 workers succeeded" in done.stdout
    # rank 0 prints the job's summary table, rank 1 one line
    chief = [int(line.split("│")[2]) for line in done.stdout.splitlines() if "│ steps " in line]
    other = [int(m) for m in re.findall(r"rank 1 finished: (\d+) steps", done.stdout)]
    assert len(chief) == 1 and len(other) == 1, done.stdout[-3000:]
    assert chief[0] != other[0], (chief, other)  # the shards really were uneven


@pytest.mark.slow
def test_a_dead_worker_fails_the_others_all_reduce_with_a_clear_error(tmp_path, unique_tsv):
    from test_distributed import run_launch

    lines = open(unique_tsv).read().splitlines()[:4000]
    lines[3500] = "garbage"  # in worker 1's half: it dies mid-run
    data = tmp_path / "half_bad.tsv"
    data.write_text("\n".join(lines) + "\n")
    done = run_launch(["--ps", "1", "--workers", "2", "--", "train", "--data", str(data), "--steps", "40",
                       "--batch-size", "64", "--dense", "allreduce"], tmp_path)
    assert done.returncode != 0 and "0/2 workers succeeded" in done.stdout
    assert line_with(done.stdout, "[worker0] error:", "the all-reduce of the dense gradients failed: another worker "
                     "is gone")
