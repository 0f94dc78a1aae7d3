"""The dense all-reduce: replicated dense parameters, their gradients averaged over the workers.
Collective training (deeprec.distributed.collective) and PS workers with `--dense allreduce`
(deeprec.distributed.ps.worker: the HybridBackend / SOK+Horovod layout, only embedding rows travel
to the PSs) both use `DenseAllReduce`, DDP's bucketed algorithm:

    backward ──grads of bucket 0 ready──> all_reduce(bucket 0, async) ─┐   (buckets in backward order,
             ──grads of bucket 1 ready──> all_reduce(bucket 1, async) ─┤    launched strictly in index
             ...                                                       │    order so every rank pairs
    apply:   wait for each bucket, grads = sum / N  <──────────────────┘    them alike)

    overlap=False (micro-batches; PS workers): nothing is launched inside the backward; apply
    launches every bucket, in the same order. A PS worker's buffer is one bucket of every parameter.
    drain=True (PS workers, whose data may end at different steps): the last bucket carries a
    "still training" flag, summed with the gradients; N is that sum, and a worker whose data has
    ended keeps joining with no gradients (`drain`) until every worker has ended, so none waits
    forever and the others average over the workers that still train.

In DLRM the top MLP's gradients (most of the dense bytes) are ready first: their all-reduce runs
while the embedding gradients are exchanged and the bottom MLP's backward runs. Written here rather
than wrapping the model in DDP: SmartStage captures the model's graph, and DDP's forward hooks would
sit inside it.

torch.distributed runs it: gloo for CPU parameters, NCCL for CUDA ones. The rendezvous comes from
MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (set by torchrun, `deeprec launch` and Kubeflow's
PyTorchJob), or, for a PS worker under a TFJob, from TF_CONFIG: worker 0's address. A worker that
dies fails the others' next all-reduce (AllReduceError, as in any collective job: restart it with
--resume); with --dense ps the PS workers go on without it.
"""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deeprec.distributed.collective.deadline import guard
from deeprec.errors import ConfigError, DeepRecError

RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
BUCKET_BYTES = 512 * 1024  # DDP's default is 25 MiB; a recommendation model's dense part is a few MiB


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
    timeout = datetime.timedelta(seconds=timeout_s)
    where = {"init_method": f"tcp://{rendezvous.master_addr}:{rendezvous.master_port}"}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent store outlives a restart of the ranks, and with it the last start's keys (gloo's
        # addresses of dead ranks, which a restarted group would wait on): a prefix per start
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(rendezvous.master_addr, rendezvous.master_port, rendezvous.world_size,
                              is_master=False, timeout=timeout)
        where = {"store": dist.PrefixStore(f"deeprec/restart-{restart}/", store)}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **where,
                            rank=rendezvous.rank, world_size=rendezvous.world_size, timeout=timeout)


def broadcast_parameters(params: list[torch.Tensor]) -> None:
    """Worker 0's parameter values to every worker (the replicas start equal), in one flat buffer."""
    if not params:
        return
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    with guard("the broadcast of the dense parameters"):
        dist.broadcast(flat, src=0)
    _unflatten(flat, [p.data for p in params])


def _unflatten(flat: torch.Tensor, into: list[torch.Tensor]) -> None:
    offset = 0
    for t in into:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class DenseAllReduce:
    """Averages `params`' gradients over the ranks of `group` each step, in buckets of about
    `bucket_bytes` (None: one bucket of every parameter, in their order). `overlap`: each bucket's
    all-reduce starts from the backward as soon as its gradients are accumulated. `drain`: workers
    may stop at different steps (the "still training" flag; see the module's docstring). `advice`:
    what an AllReduceError tells the user to do."""

    def __init__(self, params: list[torch.Tensor], group=None, *, bucket_bytes: int | None = BUCKET_BYTES,
                 overlap: bool = True, drain: bool = False,
                 advice: str = "Every worker must run: restart the job with --resume"):
        self.group, self.overlap, self.flagged, self.advice = group, overlap, drain, advice
        self.world = dist.get_world_size(group)
        self.buckets: list[list[torch.Tensor]] = [[]]
        if bucket_bytes is None:
            self.buckets = [list(params)]
        else:
            for p in reversed(params):  # backward produces gradients roughly in reverse order of definition
                if self.buckets[-1] and sum(q.numel() * q.element_size() for q in self.buckets[-1]) >= bucket_bytes:
                    self.buckets.append([])
                self.buckets[-1].append(p)
        self.buckets = [b for b in self.buckets if b] or ([[]] if drain else [])  # the flag needs a bucket
        device = params[0].device if params else torch.device("cpu")
        sizes = [sum(p.numel() for p in b) for b in self.buckets]
        if drain:
            sizes[-1] += 1  # the "still training" flag, at the end of the last bucket
        self.flats = [torch.zeros(n, device=device) for n in sizes]
        self.traffic = Traffic()  # seconds: waiting in average_gradients (what the overlap did not hide)
        self.active = True  # drain: this worker still trains
        self._reset()
        if overlap:
            for index, bucket in enumerate(self.buckets):
                for p in bucket:
                    p.register_post_accumulate_grad_hook(lambda p, index=index: self._accumulated(index))

    @property
    def numel(self) -> int:
        """The parameters' elements averaged each step."""
        return sum(p.numel() for bucket in self.buckets for p in bucket)

    def _reset(self) -> None:
        self.remaining = [len(b) for b in self.buckets]
        self.works: list = []  # launched, in bucket order

    def _accumulated(self, index: int) -> None:
        self.remaining[index] -= 1
        while len(self.works) < len(self.buckets) and self.remaining[len(self.works)] <= 0:
            self._launch(len(self.works))

    def _launch(self, index: int) -> None:
        bucket, flat = self.buckets[index], self.flats[index]
        flagged = self.flagged and index == len(self.buckets) - 1
        grads = [(torch.zeros_like(p) if p.grad is None else p.grad.to_dense()).reshape(-1) for p in bucket]
        if grads:
            torch.cat(grads, out=flat[:-1] if flagged else flat)
        if flagged:
            flat[-1] = 1.0  # this worker still trains
        self._start(flat)

    def _start(self, flat: torch.Tensor) -> None:
        try:
            with guard("the dense all-reduce"):
                self.works.append(dist.all_reduce(flat, group=self.group, async_op=True))
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._error(err) from None
        self.traffic.bytes_sent += int(2 * (self.world - 1) / self.world * flat.numel() * flat.element_size())

    def _wait_all(self) -> None:
        try:
            with guard("the dense all-reduce"):  # a stopped rank: gloo's timeout, then a CollectiveTimeout
                for work in self.works:
                    work.wait()
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._error(err) from None

    def _error(self, err: Exception) -> AllReduceError:
        return AllReduceError(f"the all-reduce of the dense gradients failed: another worker is gone ({err}). "
                              f"{self.advice}")

    def average_gradients(self) -> None:
        """Launch what the backward did not (a parameter without gradient, or overlap off), wait for
        every bucket, and leave each parameter's .grad the mean over the ranks (drain: over the ranks
        that still train)."""
        started = time.perf_counter()
        while len(self.works) < len(self.buckets):
            self._launch(len(self.works))
        self._wait_all()
        count = self.flats[-1][-1] if self.flagged else self.world  # the workers that still train, summed
        for bucket, flat in zip(self.buckets, self.flats):
            mean = flat[:-1] if self.flagged and flat is self.flats[-1] else flat
            mean /= count
            offset = 0
            for p in bucket:
                value = mean[offset:offset + p.numel()].view_as(p)
                if p.grad is None or p.grad.is_sparse:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)
                offset += p.numel()
        self.traffic.add(time.perf_counter() - started, 0)
        self._reset()

    def finite(self) -> bool:
        """Whether the averaged gradients are all finite (the same answer on every rank)."""
        for flat in self.flats:
            if not flat.numel():
                continue
            low, high = torch.aminmax(flat)
            if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
                return False
        return True

    def drain(self) -> None:
        """This worker has no more data (drain=True): join the others' all-reduces, with no gradients,
        until every worker has ended."""
        if not self.flagged:
            raise RuntimeError("drain() needs a DenseAllReduce made with drain=True (the flag it counts)")
        if not self.active:
            return
        self.active = False
        while True:
            self._reset()
            for flat in self.flats:
                flat.zero_()
                self._start(flat)
            self._wait_all()
            self._reset()
            if float(self.flats[-1][-1]) == 0.0:
                return


def leave_process_group() -> None:
    """Leave torch.distributed's default group (a PS worker joined it for the dense all-reduce)."""
    if dist.is_initialized():
        dist.destroy_process_group()
