"""Parameter-server training over gRPC (StarServer): cluster spec, PS shards, worker client."""
from deeprec.distributed.client import PROTOCOLS, PSClient, PSError
from deeprec.distributed.cluster import (ClusterSpec, TaskConfig, WorkerTask, parse_tf_config, read_endpoint_map,
                                         worker_task_from_env)
from deeprec.distributed.task_server import Server

__all__ = ["PROTOCOLS", "PSClient", "PSError", "ClusterSpec", "TaskConfig", "parse_tf_config",
           "read_endpoint_map", "Server", "WorkerTask", "worker_task_from_env"]
