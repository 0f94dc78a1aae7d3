"""Choice lists of options used in more than one place, declared once (flags, TOML keys,
the PS shard's flags and the code that checks them read these)."""

PROTOCOLS = ("grpc", "star_server", "star_server_lite")  # parameter-server protocols (StarServer's names)
DENSE_MODES = ("ps", "allreduce")  # a PS worker's dense parameters: on the PSs, or replicated and all-reduced
STORAGES = ("dram", "ssd")  # where EmbeddingVariable rows live
CACHE_POLICIES = ("lfu", "lru")  # which rows leave DRAM first
BAD_ROW_POLICIES = ("raise", "skip")
NAN_POLICIES = ("raise", "skip")
CARDINALITIES = ("kaggle", "small")  # synthetic Criteo-layout data: Kaggle's column cardinalities or small ones
SYNTH_KINDS = ("criteo", "behavior")  # deeprec data synth --kind
ALLOCATORS = ("auto", "mimalloc", "system")  # deeprec serve --allocator (serving/allocator.py)

__all__ = ["PROTOCOLS", "DENSE_MODES", "STORAGES", "CACHE_POLICIES", "BAD_ROW_POLICIES", "NAN_POLICIES",
           "CARDINALITIES", "SYNTH_KINDS", "ALLOCATORS"]
