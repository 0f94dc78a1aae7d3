"""Sparse embedding layers: EmbeddingVariable (dynamic hash) and the fused EmbeddingCollection,
both `EmbeddingLookup`s (the interface graph passes and runtimes ask)."""
from deeprec.nn.collection import EmbeddingCollection, EmbeddingFeature, FusedLookup
from deeprec.nn.lookup import EmbeddingLookup, embedding_lookups, prepare_bags
from deeprec.ragged import Ragged
from deeprec.nn.options import (CBFFilter, CounterFilter, EmbeddingVariableOption, GlobalStepEvict,
                                InitializerOption, L2WeightEvict, StorageOption)
from deeprec.nn.key_index import KeyIndex
from deeprec.nn.variable import EmbeddingVariable, incremental_state_dict, shard_of
from deeprec.nn.tiered import TieredEmbeddingVariable, embedding_variable

__all__ = ["EmbeddingCollection", "EmbeddingFeature", "FusedLookup", "EmbeddingLookup", "embedding_lookups",
           "Ragged", "prepare_bags", "CBFFilter", "CounterFilter", "EmbeddingVariableOption", "GlobalStepEvict",
           "InitializerOption", "L2WeightEvict", "StorageOption", "EmbeddingVariable", "TieredEmbeddingVariable",
           "KeyIndex", "embedding_variable", "incremental_state_dict", "shard_of"]
