"""Training on many processes: the parameter server and collective training, and what both share.

    distributed/
      cluster.py     ClusterSpec, TF_CONFIG -> WorkerTask, .endpoint_map (which process is which)
      allreduce.py   rendezvous (MASTER_ADDR/PORT) and the dense all-reduce of replicated layers (bucketed,
                     overlapped with the backward): PS workers' --dense allreduce and collective ranks
      launch.py      `deeprec launch`: PSs and workers, or torchrun-style ranks, on one machine
      ps/            the parameter server (StarServer over gRPC): shards, client, worker, Strategy
      collective/    collective training (torchrun ranks): sharded lookups by all-to-all, Strategy

Neither ps/ nor collective/ imports the other; both import only this package's shared modules.
"""
from deeprec.distributed.cluster import (ClusterSpec, TaskConfig, WorkerTask, parse_tf_config, read_endpoint_map,
                                         worker_task_from_env)
from deeprec.distributed.ps.client import PROTOCOLS, PSClient, PSError
from deeprec.distributed.ps.server import Server

__all__ = ["PROTOCOLS", "PSClient", "PSError", "ClusterSpec", "TaskConfig", "parse_tf_config",
           "read_endpoint_map", "Server", "WorkerTask", "worker_task_from_env"]
