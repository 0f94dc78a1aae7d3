"""The parameter server (DeepRec's StarServer) over gRPC.

    shard.py   a PS process: its shard's state (state.py: variables, optimizer slots; store.py:
               fused arenas; tiered.py: DRAM + disk arenas) behind a gRPC service
    wire.py    tensors as raw bytes (no pickle); security.py: token and TLS; tuning.py: DeepRec's
               NETWORK_* / *_PIN_CORES / *_POLLING variables
    client.py  PSClient: one fused pull and push per shard per step (protocols grpc, star_server,
               star_server_lite); server.py: dr.distributed.Server, as tf.train.Server
    worker.py  RemoteLookup / RemoteVariable swapped in for the model's lookups; PSUpdater
    strategy.py  ParameterServer, the Strategy the trainer runs a PS worker with

`python -m deeprec.distributed.ps --bind HOST:PORT` runs one PS shard.
"""
