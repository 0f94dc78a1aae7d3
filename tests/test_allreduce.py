"""The one dense all-reduce (deeprec.distributed.allreduce.DenseAllReduce) on 2 gloo ranks: PS
workers' drain (a worker whose data ended keeps joining until all ended) and collective training's
buckets launched from the backward, averaged bitwise as before."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 2


def _params():
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(2, 2))]


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return [torch.randn(p.shape, generator=g) for p in _params()]


def _drain_rank(rank, init_file, out_dir, bucket_bytes):
    from deeprec.distributed.allreduce import DenseAllReduce

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    params = _params()
    reducer = DenseAllReduce(params, bucket_bytes=bucket_bytes, overlap=False, drain=True)
    steps = 3 if rank == 0 else 1  # rank 1's data ends first
    means = []
    for step in range(steps):
        for p, g in zip(params, _grads(rank, step)):
            p.grad = g.clone()
        params[2].grad = None if step == 2 else params[2].grad  # no gradient: joins with zeros
        reducer.average_gradients()
        means.append([p.grad.clone() for p in params])
    reducer.drain()
    reducer.drain()  # a second call is a no-op
    torch.save({"means": means, "buckets": len(reducer.buckets)}, os.path.join(out_dir, f"drain{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("bucket_bytes", [None, 16])
def test_a_worker_whose_data_ended_drains_and_the_others_average_over_those_still_training(tmp_path, bucket_bytes):
    mp.start_processes(_drain_rank, args=(str(tmp_path / "init"), str(tmp_path), bucket_bytes), nprocs=WORLD, join=True,
                       start_method="forkserver")  # forked from a server that imported torch (conftest)
    ranks = [torch.load(tmp_path / f"drain{r}.pt") for r in range(WORLD)]
    assert ranks[0]["buckets"] == (1 if bucket_bytes is None else 3)
    assert len(ranks[0]["means"]) == 3 and len(ranks[1]["means"]) == 1
    # step 0: both train, the mean of the two, as PS workers always computed it (sum / the flags' sum)
    for k, (a, b) in enumerate(zip(_grads(0, 0), _grads(1, 0))):
        expected = (a + b) / torch.tensor(2.0)
        assert torch.equal(ranks[0]["means"][0][k], expected) and torch.equal(ranks[1]["means"][0][k], expected)
    # steps 1 and 2: rank 1 drains, rank 0 averages over itself alone
    for step in (1, 2):
        for k, g in enumerate(_grads(0, step)):
            expected = torch.zeros_like(g) if (step, k) == (2, 2) else g
            assert torch.equal(ranks[0]["means"][step][k], expected), (step, k)


def _overlap_rank(rank, init_file, out_dir):
    from deeprec.distributed.allreduce import DenseAllReduce

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    params = [p for p in model.parameters()]
    reducer = DenseAllReduce(params, bucket_bytes=1024)  # collective training: overlap, / world
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    launched = len(reducer.works)  # from the backward's hooks, before apply
    local = [p.grad.clone() for p in params]
    reducer.average_gradients()
    mean = [p.grad.clone() for p in params]
    finite = reducer.finite()
    poisoned = x.clone()
    if rank == 1:
        poisoned[0, 0] = float("nan")  # one rank's non-finite gradient spreads into the mean
    model(poisoned).mean().backward()
    reducer.average_gradients()
    torch.save({"launched": launched, "buckets": len(reducer.buckets), "local": local, "mean": mean,
                "finite": finite, "finite_after_inf": reducer.finite(),
                "traffic": (reducer.traffic.calls, reducer.traffic.bytes_sent),
                "numel": reducer.numel}, os.path.join(out_dir, f"overlap{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_collective_buckets_launch_from_the_backward_and_average_over_the_world(tmp_path):
    mp.start_processes(_overlap_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True,
                       start_method="forkserver")  # forked from a server that imported torch (conftest)
    ranks = [torch.load(tmp_path / f"overlap{r}.pt") for r in range(WORLD)]
    assert ranks[0]["buckets"] > 1 and ranks[0]["launched"] == ranks[0]["buckets"]  # all before apply
    assert ranks[0]["numel"] == 6 * 32 + 32 + 32 * 32 + 32 + 32 + 1
    for k in range(len(ranks[0]["mean"])):
        expected = (ranks[0]["local"][k] + ranks[1]["local"][k]) / WORLD
        assert torch.equal(ranks[0]["mean"][k], expected) and torch.equal(ranks[1]["mean"][k], expected)
    assert ranks[0]["finite"] and ranks[1]["finite"]
    assert not ranks[0]["finite_after_inf"] and not ranks[1]["finite_after_inf"]  # every rank sees it
    calls, bytes_sent = ranks[0]["traffic"]
    assert calls == 2 and bytes_sent == 2 * ranks[0]["numel"] * 4  # 2 (N-1)/N x the bytes, 2 steps


def test_a_reducer_without_the_flag_cannot_drain(tmp_path):
    from deeprec.distributed.allreduce import DenseAllReduce

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="drain=True"):
            DenseAllReduce([nn.Parameter(torch.zeros(3))], overlap=False).drain()
    finally:
        dist.destroy_process_group()
