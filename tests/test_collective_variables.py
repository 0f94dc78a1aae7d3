"""Free EmbeddingVariables (your own model's ev(ids), not in an EmbeddingCollection) in collective
training: sharded over 2 gloo ranks by key, as a collection's are; each rank trains on its half of
the global batch, and rows and dense weights equal one process on the whole batch (1e-6)."""
import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import custom_models as cm
import deeprec as dr
from deeprec.cli import sample_path
from deeprec.data import open_reader, resolve_schema
from deeprec.nn import shard_of
from deeprec.optim import make_optimizer
from deeprec.runtime.micro_batch import split_batch

WORLD, BATCH, STEPS = 2, 16, 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "custom_model.py")


def _example_model():
    """The README's ClickModel (examples/custom_model.py): a ModuleDict of 26 EmbeddingVariables."""
    spec = importlib.util.spec_from_file_location("custom_model_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ClickModel(resolve_schema([sample_path()], None), dim=4)


MODELS = {"readme_click_model": _example_model, "shared_names": cm.SharedNames,
          "called_twice": cm.SharedEmbedding, "mixed": cm.MixedEmbeddings}


def global_batches() -> list:
    reader = iter(open_reader([sample_path()], WORLD * BATCH, schema=resolve_schema([sample_path()], None)))
    return [next(reader) for _ in range(STEPS)]


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def variables(model: nn.Module) -> dict:
    """name -> EmbeddingVariable, every name of a shared one."""
    from deeprec.distributed.collective.variables import ShardedVariable

    out = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, dr.EmbeddingVariable):
            out[name] = m
        elif isinstance(m, ShardedVariable):
            out[name] = m.variable
    return out


def rows(model: nn.Module) -> dict:
    return {name: ev.export() for name, ev in variables(model).items()}


def _rank(rank, port, out_dir, name, mode):
    """mode "updater": the trainer's CollectiveUpdater (rows updated at the optimizer step, after the
    finite check), with SmartStage, or micro-batched ("updater-micro"); "ddp": shard_embeddings and
    DDP by hand (rows updated once the backward is done)."""
    from deeprec.distributed.collective.updater import CollectiveUpdater, shard_embeddings
    from deeprec.distributed.collective.variables import ShardedVariable

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    model = build(name)
    shared_before = {id(m) for n, m in model.named_modules(remove_duplicate=False) if n.startswith("evs.C")}
    if mode == "ddp":
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        optimizer = make_optimizer(model, "adagrad", 0.05)
        assert shard_embeddings(model) == len({id(ev) for ev in variables(model).values()})
        ddp = nn.parallel.DistributedDataParallel(model)
        for batch in global_batches():
            ddp(split_batch(batch, WORLD)[rank])["loss"].backward()
            optimizer.step()
            optimizer.zero_grad()
    else:
        micro = 2 if mode == "updater-micro" else 1
        updater = CollectiveUpdater(model, "adagrad", 0.05, rank, WORLD, overlap=micro == 1)
        fast = dr.optimize(model, dr.Config(micro_batch_num=micro, smart_stage=micro == 1))
        for batch in global_batches():
            fast.forward_backward(split_batch(batch, WORLD)[rank])
            updater.apply()
    sharded = {n: m for n, m in model.named_modules(remove_duplicate=False) if isinstance(m, ShardedVariable)}
    state = model.state_dict()
    torch.save({"rows": rows(model), "dense": {k: v.detach() for k, v in model.named_parameters()},
                "state_keys": sorted(state), "sharded": sorted(sharded),
                "one_module": len({id(sharded[n]) for n in sharded if n.startswith("evs.C")}) == len(shared_before)},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CASES = [(name, "updater") for name in sorted(MODELS)]  # micro-batched and by hand: slow (2 ranks each)
CASES += [pytest.param(name, "updater-micro", marks=pytest.mark.slow) for name in sorted(MODELS)]
CASES += [pytest.param(name, "ddp", marks=pytest.mark.slow)  # a variable's two lookups: one update
          for name in ("called_twice", "shared_names")]


@pytest.mark.slow
@pytest.mark.parametrize("name,mode", CASES)
def test_two_ranks_equal_one_process_on_the_global_batch(tmp_path, name, mode):
    mp.start_processes(_rank, args=(_free_port(), str(tmp_path), name, mode), nprocs=WORLD, join=True,
                       start_method="forkserver")  # forked from a server that imported torch (conftest)
    reference = build(name)
    optimizer = make_optimizer(reference, "adagrad", 0.05)
    for batch in global_batches():
        reference(batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    expected = rows(reference)
    assert set(ranks[0]["sharded"]) == set(expected)  # every name of every free variable: sharded
    assert ranks[0]["state_keys"] == sorted(reference.state_dict())  # saved as the one-process model names it
    assert all(r["one_module"] for r in ranks)  # one variable under two names stays one module
    for name_, want in expected.items():
        keys = torch.cat([r["rows"][name_]["keys"] for r in ranks])
        for rank, r in enumerate(ranks):  # each rank holds the keys it owns
            assert bool((shard_of(r["rows"][name_]["keys"], WORLD) == rank).all())
        assert keys.numel() == want["keys"].numel() > 0, name_
        order, want_order = torch.argsort(keys), torch.argsort(want["keys"])
        assert torch.equal(keys[order], want["keys"][want_order])
        for field in ("values", "freq", "slot.accumulator"):
            got = torch.cat([r["rows"][name_][field] for r in ranks])[order]
            torch.testing.assert_close(got, want[field][want_order], atol=1e-6, rtol=1e-5, msg=f"{name_}.{field}")
    for param, value in reference.named_parameters():
        for r in ranks:
            torch.testing.assert_close(r["dense"][param], value.detach(), atol=1e-6, rtol=1e-5, msg=param)


@pytest.mark.slow
def test_the_readme_model_trains_under_launch_collective_and_its_checkpoint_evaluates(tmp_path):
    spec = f"{EXAMPLE}:ClickModel"
    done = subprocess.run([sys.executable, "-m", "deeprec.cli", "launch", "--workers", "2", "--collective", "--",
                           "train", "--model", spec, "--data", sample_path(), "--eval-data", sample_path(),
                           "--steps", "6", "--batch-size", "16", "--checkpoint-dir", str(tmp_path / "ck")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[launch] job: 2 workers, 6 steps" in done.stdout and "eval AUC" in done.stdout
    evaluated = subprocess.run([sys.executable, "-m", "deeprec.cli", "evaluate", "--checkpoint", str(tmp_path / "ck"),
                                "--data", sample_path()], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    auc = json.loads(evaluated.stdout.strip().splitlines()[-1])["auc"]
    assert f"eval AUC {auc:.4f}" in done.stdout  # the merged checkpoint scores as the ranks did
