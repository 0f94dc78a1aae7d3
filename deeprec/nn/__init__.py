"""Sparse embedding layers: EmbeddingVariable (dynamic hash) and the fused EmbeddingCollection."""
from deeprec.nn.collection import (EmbeddingCollection, EmbeddingFeature, FusedLookup,
                                   fused_safe_embedding_lookup_sparse)
from deeprec.nn.lookup import prepare_bags
from deeprec.ragged import Ragged
from deeprec.nn.options import (CBFFilter, CounterFilter, EmbeddingVariableOption, GlobalStepEvict,
                                InitializerOption, L2WeightEvict, StorageOption)
from deeprec.nn.variable import EmbeddingVariable, KeyIndex, incremental_state_dict, shard_of

__all__ = ["EmbeddingCollection", "EmbeddingFeature", "FusedLookup", "fused_safe_embedding_lookup_sparse",
           "Ragged", "prepare_bags", "CBFFilter", "CounterFilter", "EmbeddingVariableOption", "GlobalStepEvict",
           "InitializerOption", "L2WeightEvict", "StorageOption", "EmbeddingVariable", "KeyIndex", "incremental_state_dict",
           "shard_of"]
