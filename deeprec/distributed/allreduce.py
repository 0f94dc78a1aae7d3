"""Hybrid training's dense half: dense parameters replicated on the workers, averaged by all-reduce.

    worker r: backward ──> dense grads ──one flat buffer──> all_reduce(sum) ──/ active workers──> local optimizer
              embedding grads ──> the PSs (deeprec.distributed.ps.worker)

This is the HybridBackend / SOK+Horovod layout: only embedding rows travel to the PSs.
torch.distributed runs it: gloo for CPU parameters, NCCL for CUDA ones. The rendezvous
comes from MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (set by `deeprec launch` and by
Kubeflow's PyTorchJob), or, under a TFJob, from TF_CONFIG: worker 0's address.

A worker that dies fails the others' next all-reduce (AllReduceError, as in any collective
job: restart it with --resume); with --dense ps the other workers go on without it.
Each all-reduce also sums a "still training" flag: a worker whose data has ended keeps
joining with no gradients (`drain`) until every worker has ended, so none waits forever
and the others average over the workers that still train.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deeprec.errors import ConfigError, DeepRecError

RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


class AllReduceError(DeepRecError):
    """The dense all-reduce failed: another worker is gone (a collective needs every worker)."""


@dataclass(frozen=True)
class Rendezvous:
    master_addr: str
    master_port: int
    rank: int
    world_size: int


def rendezvous_from_env(rank: int, world_size: int, master: str | None = None) -> Rendezvous:
    """torch.distributed's rendezvous for worker `rank` of `world_size`: from MASTER_ADDR,
    MASTER_PORT, RANK, WORLD_SIZE when set (checked against the PS job's view), else
    `master` ("host:port" of worker 0, from TF_CONFIG)."""
    given = [k for k in RENDEZVOUS_ENV if os.environ.get(k)]
    if given:
        missing = [k for k in RENDEZVOUS_ENV if k not in given]
        if missing:
            raise ConfigError(f"--dense allreduce: {', '.join(given)} set but not {', '.join(missing)}")
        values = {}
        for key in ("MASTER_PORT", "RANK", "WORLD_SIZE"):
            try:
                values[key] = int(os.environ[key])
            except ValueError:
                raise ConfigError(f"{key} must be an integer, got {os.environ[key]!r}") from None
        if (values["RANK"], values["WORLD_SIZE"]) != (rank, world_size):
            raise ConfigError(f"RANK={values['RANK']}, WORLD_SIZE={values['WORLD_SIZE']} disagree with the PS job: "
                              f"this is worker {rank} of {world_size}")
        return Rendezvous(os.environ["MASTER_ADDR"], values["MASTER_PORT"], rank, world_size)
    if master is None:
        raise ConfigError("--dense allreduce with several workers needs a rendezvous: set MASTER_ADDR, MASTER_PORT, "
                          "RANK, WORLD_SIZE (deeprec launch and PyTorchJob do), or run under TF_CONFIG")
    host, _, port = master.rpartition(":")
    return Rendezvous(host, int(port), rank, world_size)


@dataclass
class Traffic:
    """A collective's cost on this rank: seconds inside it (waiting for the slowest rank
    included), bytes sent to other ranks, calls."""

    seconds: float = 0.0
    bytes_sent: int = 0
    calls: int = 0

    def add(self, seconds: float, bytes_sent: int) -> None:
        self.seconds += seconds
        self.bytes_sent += bytes_sent
        self.calls += 1


def join_process_group(rendezvous: Rendezvous, device: torch.device, timeout_s: float = 300.0) -> None:
    """torch.distributed's default group for this worker: NCCL for parameters on a GPU, gloo on CPU."""
    if dist.is_initialized():
        raise ConfigError("torch.distributed is already initialized in this process: one worker per process")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://{rendezvous.master_addr}:{rendezvous.master_port}",
                            rank=rendezvous.rank, world_size=rendezvous.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def broadcast_parameters(params: list[torch.Tensor]) -> None:
    """Worker 0's parameter values to every worker (the replicas start equal), in one flat buffer."""
    if not params:
        return
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    dist.broadcast(flat, src=0)
    _unflatten(flat, [p.data for p in params])


def _unflatten(flat: torch.Tensor, into: list[torch.Tensor]) -> None:
    offset = 0
    for t in into:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class DenseAllReduce:
    """Averages `params`' gradients over the workers each step, in one flat buffer."""

    def __init__(self, params: list[torch.Tensor], rendezvous: Rendezvous, timeout_s: float = 300.0):
        self.params = params
        device = params[0].device if params else torch.device("cpu")
        join_process_group(rendezvous, device, timeout_s)
        self.world_size = rendezvous.world_size
        self._flat = torch.zeros(sum(p.numel() for p in params) + 1, device=device)  # + the "training" flag
        self.active = True

    def broadcast_parameters(self) -> None:
        """Worker 0's parameter values to every worker (the replicas start equal)."""
        broadcast_parameters(self.params)

    def average_gradients(self) -> None:
        """Each parameter's .grad becomes the mean over the workers that still train."""
        flat = self._flat
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.to_dense() for p in self.params]
        torch.cat([g.reshape(-1) for g in grads], out=flat[:-1])
        flat[-1] = 1.0
        self._all_reduce(flat)
        flat[:-1] /= flat[-1]
        for p, g in zip(self.params, grads):
            p.grad = g
        _unflatten(flat[:-1], grads)

    def drain(self) -> None:
        """This worker has no more data: join the others' all-reduces until all have ended."""
        if not self.active:
            return
        self.active = False
        while True:
            self._flat.zero_()
            self._all_reduce(self._flat)
            if float(self._flat[-1]) == 0.0:
                return

    def close(self) -> None:
        self.drain()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _all_reduce(self, flat: torch.Tensor) -> None:
        try:
            dist.all_reduce(flat)
        except (RuntimeError, dist.DistBackendError) as err:
            raise AllReduceError(f"the all-reduce of the dense gradients failed: another worker is gone ({err}). "
                                 "With --dense allreduce every worker must run (restart the job with --resume); "
                                 "--dense ps lets the other workers go on") from None
