"""Cluster description: `ClusterSpec`, `TF_CONFIG`, and `.endpoint_map` (seed: star-server.md).

TF_CONFIG is what Kubernetes operators such as Kubeflow's TFJob set for each replica:

    {"cluster": {"ps": ["ps-0:2222", "ps-1:2222"], "worker": ["worker-0:2222", ...]},
     "task": {"type": "worker", "index": 0}}

`.endpoint_map` (in the working directory) maps a task's cluster address to the
address its data plane actually listens on / is reached at, one "cluster_addr data_addr" per line.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from deeprec.errors import ConfigError

class ClusterSpec:
    """Jobs and their task addresses, like `tf.train.ClusterSpec`."""

    def __init__(self, cluster: dict[str, list[str]]):
        if not isinstance(cluster, dict) or not cluster:
            raise ConfigError("ClusterSpec needs a dict of job name -> list of 'host:port'")
        self._jobs = {}
        for job, tasks in cluster.items():
            if isinstance(tasks, dict):  # TF also allows {index: address}
                tasks = [tasks[k] for k in sorted(tasks, key=int)]
            for address in tasks:
                host, sep, port = str(address).rpartition(":")
                if not sep or not host or not port.isdigit():
                    raise ConfigError(f"job {job!r}: address {address!r} is not 'host:port'")
            self._jobs[job] = [str(a) for a in tasks]

    @property
    def jobs(self) -> list[str]:
        return list(self._jobs)

    def job_tasks(self, job: str) -> list[str]:
        if job not in self._jobs:
            raise ConfigError(f"no job {job!r} in the cluster (jobs: {', '.join(self._jobs)})")
        return list(self._jobs[job])

    def num_tasks(self, job: str) -> int:
        return len(self._jobs.get(job, []))

    def task_address(self, job: str, index: int) -> str:
        tasks = self.job_tasks(job)
        if not 0 <= index < len(tasks):
            raise ConfigError(f"job {job!r} has tasks 0..{len(tasks) - 1}, not {index}")
        return tasks[index]

    def as_dict(self) -> dict[str, list[str]]:
        return {job: list(tasks) for job, tasks in self._jobs.items()}

    def __eq__(self, other) -> bool:
        return isinstance(other, ClusterSpec) and self.as_dict() == other.as_dict()

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()})"


@dataclass(frozen=True)
class TaskConfig:
    cluster: ClusterSpec
    job_name: str
    task_index: int


def parse_tf_config(text: str | None = None) -> TaskConfig:
    """The cluster and this task from TF_CONFIG (the environment variable by default)."""
    text = os.environ.get("TF_CONFIG") if text is None else text
    if not text:
        raise ConfigError("TF_CONFIG is not set")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"TF_CONFIG is not valid JSON: {err}") from err
    if "cluster" not in config or "task" not in config:
        raise ConfigError("TF_CONFIG needs 'cluster' and 'task' entries")
    task = config["task"]
    job, index = task.get("type"), task.get("index", 0)
    cluster = ClusterSpec(config["cluster"])
    if job not in cluster.jobs:
        raise ConfigError(f"TF_CONFIG task type {job!r} is not a job of the cluster ({', '.join(cluster.jobs)})")
    cluster.task_address(job, int(index))
    return TaskConfig(cluster, job, int(index))


@dataclass(frozen=True)
class WorkerTask:
    """What a PS worker needs from TF_CONFIG: the PSs' data-plane addresses and its place."""

    ps_addresses: list[str]
    index: int
    num_workers: int
    protocol: str | None  # DEEPREC_PROTOCOL, set by `deeprec launch`
    master: str | None = None  # worker 0's address: the all-reduce rendezvous under a TFJob

    @property
    def is_chief(self) -> bool:
        return self.index == 0


@dataclass(frozen=True)
class PSTask:
    """What a PS shard needs from TF_CONFIG."""

    shard: int
    num_shards: int
    num_workers: int
    address: str  # this task's data-plane address (cluster address through .endpoint_map)


def task_from_env(job: str) -> WorkerTask | PSTask | None:
    """This process's task from TF_CONFIG (None when it is not set): a WorkerTask for
    job="worker" (PS addresses mapped through `.endpoint_map`), a PSTask for job="ps".
    The one place TF_CONFIG becomes what a task needs."""
    if not os.environ.get("TF_CONFIG"):
        return _pytorch_job_worker() if job == "worker" else None
    task = parse_tf_config()
    cluster = task.cluster
    if job == "ps":
        if task.job_name != "ps":
            raise ConfigError(f"TF_CONFIG describes a {task.job_name!r} task, not a ps task")
        return PSTask(task.task_index, cluster.num_tasks("ps"), cluster.num_tasks("worker") + cluster.num_tasks("chief"),
                      ps_addresses(cluster)[task.task_index])
    if task.job_name not in ("worker", "chief"):
        raise ConfigError(f"`deeprec train` runs worker tasks; TF_CONFIG says {task.job_name!r} "
                          "(start PS tasks with `python -m deeprec.distributed.ps`)")
    workers = cluster.job_tasks("worker")
    return WorkerTask(ps_addresses(cluster), task.task_index, len(workers), os.environ.get("DEEPREC_PROTOCOL"),
                      master=workers[0] if workers else None)


def _pytorch_job_worker() -> WorkerTask | None:
    """A worker of a Kubeflow PyTorchJob (no TF_CONFIG): the PSs from DEEPREC_PS_ADDRESSES
    ("host:port,host:port"), its place from RANK and WORLD_SIZE."""
    addresses = os.environ.get("DEEPREC_PS_ADDRESSES")
    if not addresses:
        return None
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError(f"RANK and WORLD_SIZE must be integers, got {os.environ.get('RANK')!r}, "
                          f"{os.environ.get('WORLD_SIZE')!r}") from None
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
    ps = [a.strip() for a in addresses.split(",") if a.strip()]
    for address in ps:
        if not address.rpartition(":")[2].isdigit():
            raise ConfigError(f"DEEPREC_PS_ADDRESSES: {address!r} is not 'host:port'")
    return WorkerTask(ps, rank, world, os.environ.get("DEEPREC_PROTOCOL"))


def worker_task_from_env() -> WorkerTask | None:
    return task_from_env("worker")


def ps_addresses(cluster: ClusterSpec, endpoints: dict[str, str] | None = None) -> list[str]:
    """The PS tasks' data-plane addresses (`.endpoint_map` applied)."""
    endpoints = read_endpoint_map() if endpoints is None else endpoints
    return [endpoints.get(a, a) for a in cluster.job_tasks("ps")] if "ps" in cluster.jobs else []


def read_endpoint_map(path: str = ".endpoint_map") -> dict[str, str]:
    """cluster address -> data-plane address, from `path` if it exists."""
    if not os.path.exists(path):
        return {}
    mapping = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ConfigError(f"{path}:{number}: expected 'cluster_address data_address', got {line!r}")
            mapping[parts[0]] = parts[1]
    return mapping
