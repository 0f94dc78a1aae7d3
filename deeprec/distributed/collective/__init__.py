"""Collective training: every process a torch.distributed rank (torchrun), no parameter server.

    sharded.py   ShardedLookup (embedding rows sharded over the ranks, exchanged by all-to-all),
                 CollectiveUpdater (dense gradients: deeprec.distributed.allreduce's bucketed
                 all-reduce, overlapped with the backward), evaluation of every rank's share in lockstep
    planner.py   where each fixed table goes: row-wise or table-wise (FixedShard)
    reshard.py   per-rank checkpoints, restored onto any number of ranks
    strategy.py  Collective, the Strategy the trainer runs a rank with
    deadline.py  --collective-timeout: every group's timeout, errors naming the rank that stopped
                 answering (heartbeats in the rendezvous store), a watchdog that bounds what ignores it
"""
