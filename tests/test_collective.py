"""Collective training: EmbeddingVariables sharded over 2 gloo ranks by all-to-all, dense by DDP."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import deeprec as dr
from deeprec.checkpoint import load_checkpoint
from deeprec.distributed.collective.sharded import evaluate_sharded
from deeprec.distributed.collective.updater import shard_embeddings
from deeprec.errors import ConfigError
from deeprec.metrics import evaluate
from deeprec.nn import shard_of
from deeprec.optim import make_optimizer
from output import line_with

WORLD, BATCH, STEPS = 2, 16, 20
FIXED_SIZES = {"a": 50, "b": 30, "c": 5}


class Tiny(nn.Module):
    """EmbeddingVariables, or fixed tables: a and b large enough to go row-wise, c table-wise."""

    def __init__(self, fixed: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.fixed = fixed
        sizes = FIXED_SIZES if fixed else {"a": None, "b": None}
        self.emb = dr.EmbeddingCollection([dr.nn.EmbeddingFeature(name, rows, combiner="mean" if name == "b" else "sum")
                                           for name, rows in sizes.items()], 4)
        self.top = nn.Linear(4 * len(sizes), 1)

    def forward(self, ids):
        ids = {**ids, "c": ids["a"] % 5} if self.fixed else ids
        return self.top(self.emb(ids).flatten(1)).squeeze(1)


def global_batches():
    g = torch.Generator().manual_seed(3)
    return [({"a": torch.randint(0, 50, (WORLD * BATCH,), generator=g),
              "b": torch.randint(0, 30, (WORLD * BATCH, 3), generator=g)},
             torch.randint(0, 2, (WORLD * BATCH,), generator=g).float()) for _ in range(STEPS)]


def train(model, optimizer, batches, part=slice(None)):
    for ids, labels in batches:
        logits = model({k: v[part] for k, v in ids.items()})
        nn.functional.binary_cross_entropy_with_logits(logits, labels[part]).backward()
        optimizer.step()
        optimizer.zero_grad()


def rows(model) -> dict:
    return {f"{name}.{k}": v for name, ev in model.named_modules() if isinstance(ev, dr.EmbeddingVariable)
            for k, v in ev.export().items()}


class Scored(nn.Module):
    """Tiny as deeprec.metrics.evaluate sees a model: batch dict in, {"logits"} out."""

    def __init__(self, tiny):
        super().__init__()
        self.tiny = tiny

    def forward(self, batch):
        return {"logits": self.tiny({"a": batch["a"], "b": batch["b"]})}


def eval_batches():
    g = torch.Generator().manual_seed(5)
    return [{"a": torch.randint(0, 80, (n,), generator=g), "b": torch.randint(0, 40, (n, 3), generator=g),
             "label": torch.randint(0, 2, (n,), generator=g).float()} for n in (16, 9, 16, 5)]


def _rank(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    model = Tiny()
    optimizer = make_optimizer(model, "adagrad", 0.05)
    assert shard_embeddings(model) == 1
    ddp = nn.parallel.DistributedDataParallel(model)
    train(ddp, optimizer, global_batches(), slice(rank * BATCH, (rank + 1) * BATCH))
    share = eval_batches()[:3] if rank == 0 else eval_batches()[3:]  # uneven: rank 1 waits 2 batches
    metrics = evaluate_sharded(Scored(model), share)
    try:
        evaluate_sharded(Scored(model), eval_batches() if rank == 0 else [])
        empty = None
    except ConfigError as err:
        empty = str(err)
    torch.save({"dense": {k: v.detach() for k, v in model.named_parameters()}, "rows": rows(model),
                "eval": metrics, "empty": empty}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _rank_fixed(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    model = Tiny(fixed=True)
    optimizer = make_optimizer(model, "adagrad", 0.05)
    assert shard_embeddings(model) == 1
    train(nn.parallel.DistributedDataParallel(model), optimizer, global_batches(),
          slice(rank * BATCH, (rank + 1) * BATCH))
    plans = {p.name: (p.placement, p.owner) for p in model.emb.lookup.plans}
    torch.save({"state": model.state_dict(), "plans": plans}, os.path.join(out_dir, f"fixed{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_fixed_tables_sharded_row_and_table_wise_equal_one_process(tmp_path):
    from deeprec.distributed.collective.reshard import merge_rank_states
    from deeprec.distributed.collective.planner import FixedShard, plan_tables

    mp.start_processes(_rank_fixed, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True,
                       start_method="forkserver")  # forked from a server that imported torch (conftest)
    reference = Tiny(fixed=True)
    train(reference, make_optimizer(reference, "adagrad", 0.05), global_batches())
    ranks = [torch.load(tmp_path / f"fixed{r}.pt") for r in range(WORLD)]
    assert ranks[0]["plans"] == ranks[1]["plans"]
    assert ranks[0]["plans"]["a"] == ("row-wise", None) and ranks[0]["plans"]["c"][0] == "table-wise"
    lookup, offset = reference.emb.lookup, 0
    for t, (name, size) in enumerate(FIXED_SIZES.items()):
        keys = torch.cat([r["state"][f"emb.lookup.variables.{t}.keys"] for r in ranks])
        assert sorted(keys.tolist()) == list(range(size))  # every row on exactly one rank
        for field, full in (("values", lookup.weight), ("slot.accumulator", lookup.slot_accumulator)):
            got = torch.cat([r["state"][f"emb.lookup.variables.{t}.{field}"] for r in ranks])[torch.argsort(keys)]
            torch.testing.assert_close(got, full.detach()[offset:offset + size], atol=1e-6, rtol=1e-5)
        offset += size
    for name, value in reference.named_parameters():
        if value.requires_grad:
            torch.testing.assert_close(ranks[0]["state"][name], value.detach(), atol=1e-6, rtol=1e-5)

    # 2 ranks' shards onto 3: each new shard takes exactly its rows of the old ones
    merged = merge_rank_states([{"model": r["state"]} for r in ranks])["model"]
    plans = plan_tables([(n, size, 4) for n, size in FIXED_SIZES.items()], 3, 4)
    for t, (plan, size) in enumerate(zip(plans, FIXED_SIZES.values())):
        shards = [FixedShard(torch.zeros(size, 4), {"accumulator": torch.zeros(size, 4)}, plan, r, 3) for r in range(3)]
        prefix = f"emb.lookup.variables.{t}."
        for r, shard in enumerate(shards):
            shard.load_state_dict({k[len(prefix):]: v for k, v in merged.items() if k.startswith(prefix)})
        table = torch.zeros(size, 4)
        for shard in shards:
            table[shard.state_dict()["keys"]] = shard.weight
        old = merged[prefix + "values"][torch.argsort(merged[prefix + "keys"])]
        assert torch.equal(table, old)


class Lossy(nn.Module):
    """Tiny with its loss; `scale` nan poisons one rank's loss."""

    def __init__(self):
        super().__init__()
        self.tiny = Tiny()

    def forward(self, batch):
        logits = self.tiny({"a": batch["a"], "b": batch["b"]})
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch["label"]) * batch["scale"].mean()
        return {"loss": loss, "logits": logits}


def _rank_nan(rank, port, out_dir):
    from deeprec.distributed.collective.updater import CollectiveUpdater
    from deeprec.errors import NonFiniteError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    model = Lossy()
    updater = CollectiveUpdater(model, "adagrad", 0.05, rank, WORLD)
    fast = dr.optimize(model)
    part, stopped, before = slice(rank * BATCH, (rank + 1) * BATCH), None, None
    try:
        for step, (ids, labels) in enumerate(global_batches()[:6]):
            if step == 3:
                before = rows(model)
            nan = rank == 1 and step == 3
            out = fast.forward_backward({"a": ids["a"][part], "b": ids["b"][part], "label": labels[part],
                             "scale": torch.full((BATCH,), float("nan") if nan else 1.0)})
            updater.discard() if "nonfinite" in out else updater.apply()
    except NonFiniteError as err:
        stopped = (updater.step, str(err))
    torch.save({"stopped": stopped, "before": before, "after": rows(model)}, os.path.join(out_dir, f"nan{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_nan_on_one_rank_stops_every_rank_with_nothing_applied(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_nan, args=(port, str(tmp_path)), nprocs=WORLD, join=True,
                       start_method="forkserver")  # forked from a server that imported torch (conftest)
    ranks = [torch.load(tmp_path / f"nan{r}.pt") for r in range(WORLD)]
    assert ranks[1]["stopped"][0] == ranks[0]["stopped"][0] == 3  # both stop at the 4th step, neither hangs
    assert "on this rank" in ranks[1]["stopped"][1] and "averaged over the ranks" in ranks[0]["stopped"][1]
    for r in ranks:  # the poisoned step updated no row (its lookups may insert new keys, as in one process)
        for name in [k for k in r["before"] if k.endswith(".keys")]:
            prefix = name[: -len("keys")]
            after = {int(k): i for i, k in enumerate(r["after"][name])}
            where = torch.tensor([after[int(k)] for k in r["before"][name]], dtype=torch.long)
            for field in ("values", "slot.accumulator", "version"):
                assert torch.equal(r["before"][prefix + field], r["after"][prefix + field][where]), prefix + field


@pytest.mark.slow
def test_two_ranks_equal_one_process_on_the_global_batch(tmp_path):
    mp.start_processes(_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True,
                       start_method="forkserver")  # forked from a server that imported torch (conftest)
    reference = Tiny()
    train(reference, make_optimizer(reference, "adagrad", 0.05), global_batches())
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    expected_eval = evaluate(Scored(reference), eval_batches())
    for r in ranks:  # every rank holds the metrics of all ranks' shares
        assert r["eval"]["rows"] == expected_eval["rows"] == 46
        assert abs(r["eval"]["auc"] - expected_eval["auc"]) < 1e-12
        assert abs(r["eval"]["logloss"] - expected_eval["logloss"]) < 1e-6
        assert "1 rank(s) got no evaluation rows" in r["empty"]  # both ranks stop, neither hangs
    for name, value in reference.named_parameters():  # DDP: every rank holds the same dense weights
        for r in ranks:
            torch.testing.assert_close(r["dense"][name], value.detach(), atol=1e-6, rtol=1e-5)
    expected = rows(reference)
    for prefix in {k.rsplit(".", 1)[0] for k in expected if k.endswith(".keys")}:
        keys = torch.cat([r["rows"][f"{prefix}.keys"] for r in ranks])
        assert keys.numel() == expected[f"{prefix}.keys"].numel()  # each key on exactly one rank
        order, ref_order = torch.argsort(keys), torch.argsort(expected[f"{prefix}.keys"])
        for field in ("values", "freq", "slot.accumulator"):
            got = torch.cat([r["rows"][f"{prefix}.{field}"] for r in ranks])[order]
            torch.testing.assert_close(got, expected[f"{prefix}.{field}"][ref_order], atol=1e-6, rtol=1e-5)


def torchrun(ranks: int, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                           "--standalone", "-m", "deeprec", "train", "--embedding", "variable", "--optimizer",
                           "adagrad", "--batch-size", "64", "--no-progress", "--threads", "1", *args],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def by_key(state: dict) -> dict:
    """The state with every EmbeddingVariable's rows sorted by key."""
    out = dict(state)
    for name in [k for k in state if k.endswith(".keys")]:
        prefix, order = name[: -len("keys")], torch.argsort(state[name])
        for k, v in state.items():
            if k.startswith(prefix) and isinstance(v, torch.Tensor) and v.dim() > 0:
                out[k] = v[order]
    return out


def rank_states(ckpt, world: int, step: int) -> list[dict]:
    return [load_checkpoint(str(ckpt / f"rank-{r}-of-{world}" / f"checkpoint-{step:09d}.pt"))["model"]
            for r in range(world)]


@pytest.mark.slow
def test_torchrun_trains_two_ranks_then_resumes_resharded_on_three(tmp_path, unique_tsv):
    ckpt = tmp_path / "ckpt"
    done = torchrun(2, "--data", unique_tsv, "--steps", "8", "--checkpoint-dir", str(ckpt), "--eval-data", unique_tsv)
    evals = [line for line in done.stdout.splitlines() if "eval rows" in line]
    assert len(evals) == 1 and "10,000" in evals[0]  # one summary, rank 0's: all rows, gathered
    other = line_with(done.stderr, "[rank 1] rank 1 finished", "on 10,000 eval rows")  # it carries its rank
    auc = [line.split("│")[-2].strip() for line in done.stdout.splitlines() if "eval AUC" in line]
    auc.append(other.split("eval AUC ")[1].split()[0])
    assert f"{assert_one_process_evaluates(ckpt, unique_tsv)['auc']:.4f}" == auc[0] == auc[1]
    assert "job samples/s" in done.stdout
    states = rank_states(ckpt, 2, 8)
    dense = [k for k, v in states[0].items() if isinstance(v, torch.Tensor) and "variables" not in k
             and v.is_floating_point()]
    assert dense and all(torch.equal(states[0][k], states[1][k]) for k in dense)  # replicas stay equal
    key_names = [k for k in states[0] if k.endswith(".keys")]
    assert key_names
    for name in key_names:
        for rank, state in enumerate(states):  # each rank holds only the rows it owns
            assert bool((shard_of(state[name], 2) == rank).all())
    assert sum(states[r][key_names[0]].numel() for r in range(2)) > 0

    # SmartStage (a background thread) and micro-batching keep the math of collective training
    combined = tmp_path / "combined"
    torchrun(2, "--data", unique_tsv, "--steps", "8", "--checkpoint-dir", str(combined), "--smart-stage",
             "--stage-executor", "thread", "--micro-batch", "2")
    for plain, staged in zip(states, rank_states(combined, 2, 8)):
        plain, staged = by_key(plain), by_key(staged)  # rows are numbered in insertion order
        assert plain.keys() == staged.keys()
        for k, v in plain.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                torch.testing.assert_close(staged[k], v, atol=1e-6, rtol=1e-5, msg=k)
            elif isinstance(v, torch.Tensor):
                assert torch.equal(staged[k], v), k

    # 2 ranks -> 3 ranks: every old row lands on its new owner, unchanged until it is trained again
    done = torchrun(3, "--data", unique_tsv, "--steps", "10", "--checkpoint-dir", str(ckpt), "--resume")
    assert "resharded 2 ranks' checkpoints onto 3 ranks" in done.stderr + done.stdout
    after = rank_states(ckpt, 3, 10)
    assert all(torch.equal(after[0][k], after[r][k]) for k in dense for r in (1, 2))
    untouched = 0
    for name in key_names:
        prefix = name[: -len("keys")]
        for rank, state in enumerate(after):
            assert bool((shard_of(state[name], 3) == rank).all())
        old = {int(k): (v, ver) for s in states for k, v, ver in zip(s[name], s[prefix + "values"], s[prefix + "version"])}
        new = {int(k): (v, ver) for s in after for k, v, ver in zip(s[name], s[prefix + "values"], s[prefix + "version"])}
        assert set(old) <= set(new)  # no row lost
        same = [k for k in old if int(new[k][1]) <= 8]  # not updated since the resume
        assert all(torch.equal(old[k][0], new[k][0]) for k in same)
        assert all(int(new[k][1]) > 8 for k in set(new) - set(old))
        untouched += len(same)
    assert untouched > 0


def assert_one_process_evaluates(ckpt, data: str, env=None) -> dict:
    import json

    done = subprocess.run([sys.executable, "-m", "deeprec", "evaluate", "--checkpoint", str(ckpt), "--data", data],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert line_with(done.stderr + done.stdout, "ranks' checkpoint-")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_launch_collective_runs_ranks_without_a_ps(tmp_path):
    env = dict(os.environ, DEEPREC_CACHE=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "deeprec.cli", "launch", "--workers", "2", "--collective", "--",
                           "train", "--synthetic", "4000", "--cardinalities", "small",  # fixed tables: sharded by the plan
                           "--steps", "6", "--batch-size", "128", "--eval-batch-size", "512", "--checkpoint-dir",
                           str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=300, env=env)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "[ps0]" not in out and "2/2 workers succeeded" in out
    rows = [line for line in out.splitlines() if "eval rows" in line and "│" in line]  # one summary: rank 0's
    assert len(rows) == 1 and "[launch] job: 2 workers, 6 steps" in out
    assert line_with(out, "[worker1]", f"on {rows[0].split('│')[-2].strip()} eval rows")  # both: the whole file
    # the ranks' checkpoints, merged into one process's model (fixed tables back into one weight),
    # evaluate as the ranks did
    auc = [line.split("│")[-2].strip() for line in out.splitlines() if "eval AUC" in line and "│" in line]
    auc.append(line_with(out, "[worker1]", "eval AUC ").split("eval AUC ")[1].split()[0])
    evaluated = assert_one_process_evaluates(tmp_path / "ckpt", str(next(tmp_path.glob("*eval*.tsv"))), env)
    assert f"{evaluated['auc']:.4f}" == auc[0] == auc[1]
    refused = subprocess.run([sys.executable, "-m", "deeprec.cli", "launch", "--collective", "--ps", "1", "--",
                              "train"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--collective starts no parameter server" in refused.stderr


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL: one GPU per rank)")
def test_torchrun_on_two_gpus_with_nccl(tmp_path, unique_tsv):
    ckpt = tmp_path / "ckpt"
    done = torchrun(2, "--data", unique_tsv, "--steps", "8", "--checkpoint-dir", str(ckpt), "--device", "cuda",
                    "--embedding", "table", "--eval-data", unique_tsv)
    assert "cuda:0" in done.stdout and "cuda:1" in done.stdout
    states = rank_states(ckpt, 2, 8)
    dense = [k for k, v in states[0].items() if isinstance(v, torch.Tensor) and "variables" not in k
             and v.is_floating_point()]
    assert dense and all(torch.equal(states[0][k], states[1][k]) for k in dense)


def test_planner_spreads_big_tables_and_packs_small_ones():
    from deeprec.distributed.collective.planner import describe_plan, plan_tables

    tables = [("huge", 1_000_000, 16), ("ev", None, 16)] + [(f"s{i}", 1000 * (i + 1), 16) for i in range(6)]
    plans = {p.name: p for p in plan_tables(tables, 4, slot_floats_per_row=16)}
    assert plans["huge"].placement == "row-wise" and plans["ev"].placement == "row-wise"
    small = [plans[f"s{i}"] for i in range(6)]
    assert all(p.placement == "table-wise" for p in small)
    load = [sum(p.bytes for p in small if p.owner == r) for r in range(4)]
    assert max(load) - min(load) <= max(p.bytes for p in small)  # greedy, largest first: balanced within a table
    assert plans["s5"].bytes == 6000 * 32 * 4  # values + Adagrad's per-element slot
    lines = describe_plan(list(plans.values()), 4)
    assert "  huge: 1,000,000 rows, 122.1 MiB, row-wise (row % N)" in lines
    assert "ev: grows, row-wise (key % 1000 % N)" in " ".join(lines) and "fixed tables per rank" in lines[-1]


@pytest.mark.slow
def test_explain_prints_the_sharding_plan():
    done = subprocess.run([sys.executable, "-m", "deeprec", "explain", "--model", "dlrm", "--ranks", "4",
                           "--no-smart-stage", "--embedding", "table"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "collective sharding over 4 ranks" in done.stdout and "table-wise (on rank 3)" in done.stdout


def test_the_plan_lists_free_embedding_variables_under_every_name():
    import custom_models as cm
    from deeprec.distributed.collective.planner import plan_model

    lines = plan_model(cm.SharedNames(), 2)
    assert "free EmbeddingVariables over 2 ranks (all-to-all of their rows each step):" in lines
    assert any(line.startswith("  evs.C1 = evs.C2: grows,") and "row-wise (key % 1000 % N)" in line for line in lines)


@pytest.mark.slow
def test_launch_collective_stops_every_rank_when_one_fails(tmp_path, unique_tsv):
    lines = open(unique_tsv).read().splitlines()[:4000]
    lines[3500] = "garbage"  # in rank 1's byte range: it stops at once, rank 0 would wait for it forever
    data = tmp_path / "half_bad.tsv"
    data.write_text("\n".join(lines) + "\n")
    done = subprocess.run([sys.executable, "-m", "deeprec.cli", "launch", "--workers", "2", "--collective", "--",
                           "train", "--data", str(data), "--steps", "40", "--batch-size", "64", "--no-progress"],
                          capture_output=True, text=True, timeout=240)
    out = done.stdout
    assert done.returncode != 0 and "worker1 failed" in out and "0/2 workers succeeded" in out
    assert "stopping the other ranks" in out
    assert line_with(out, "[worker1]", f"{data}:3501: expected 40 fields, found 1")


def test_the_one_evaluation_loop_runs_uncounted_batches_without_counting_them():
    from deeprec.metrics import Uncounted, run_evaluation

    calls = []

    class Counting(Scored):
        def forward(self, batch):
            calls.append(self.training)
            return super().forward(batch)

    model = Counting(Tiny())
    batches = eval_batches()
    evaluation = run_evaluation(model, [batches[0], Uncounted(batches[0]), batches[1]], progress=False)
    assert calls == [False, False, False] and model.training  # eval mode for the pass, then restored
    assert evaluation.result() == evaluate(model, batches[:2])  # the uncounted batch ran, uncounted
    assert evaluation.result()["rows"] == 16 + 9
