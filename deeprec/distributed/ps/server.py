"""`dr.distributed.Server(cluster, job_name, task_index, protocol)`, like `tf.train.Server`."""
from __future__ import annotations

from deeprec.security import read_token
from deeprec.distributed.ps.client import PROTOCOLS
from deeprec.distributed.cluster import ClusterSpec, ps_addresses, read_endpoint_map
from deeprec.errors import ConfigError, check_choice


class Server:
    """A PS task serves its shard; a worker task only resolves its PS addresses.

    The PS binds to loopback on its cluster port unless `bind_address` is given
    (e.g. "0.0.0.0:2222" inside a pod) or `.endpoint_map` maps its address.
    """

    def __init__(self, cluster: ClusterSpec | dict, job_name: str, task_index: int, protocol: str = "star_server",
                 bind_address: str | None = None, start: bool = True):
        self.cluster = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec(cluster)
        check_choice("protocol", protocol, PROTOCOLS)
        if job_name not in self.cluster.jobs:
            raise ConfigError(f"job_name {job_name!r} is not a job of the cluster ({', '.join(self.cluster.jobs)})")
        self.job_name, self.task_index, self.protocol = job_name, task_index, protocol
        endpoints = read_endpoint_map()
        address = self.cluster.task_address(job_name, task_index)
        self.data_address = endpoints.get(address, address)
        self.ps_addresses = ps_addresses(self.cluster, endpoints)
        self._server = None
        self.port = None
        if bind_address is None:
            bind_address = "127.0.0.1:" + self.data_address.rpartition(":")[2]
        self.bind_address = bind_address
        if start and job_name == "ps":
            self.start()

    def start(self) -> None:
        from deeprec.distributed.ps.shard import serve

        workers = sum(self.cluster.num_tasks(j) for j in ("worker", "chief") if j in self.cluster.jobs)
        self._server, self.port = serve(self.bind_address, self.task_index, self.cluster.num_tasks("ps"),
                                        connections=workers or 8, token=read_token())

    @property
    def target(self) -> str:
        return self.data_address

    def join(self) -> None:
        """Block until the server stops (a PS task's main loop)."""
        if self._server is None:
            raise ConfigError(f"a {self.job_name!r} task has no server to join")
        self._server.wait_for_termination()

    def stop(self, grace: float | None = None) -> None:
        if self._server is not None:
            self._server.stop(grace)
