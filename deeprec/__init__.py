"""deeprec: DeepRec's training system for PyTorch users.

    import deeprec as dr
    model = dr.models.build_model("dlrm")
    fast = dr.optimize(model, dr.Config(smart_stage=True))
    for out in fast.iterate(dr.data.CriteoReader("day_0.tsv", batch_size=512)):
        out["loss"].backward(); ...
"""
from deeprec import data, errors, models, nn, ops, optim
from deeprec.config import Config, SmartStageOptions, ThreadPoolOptions
from deeprec.errors import ConfigError, DataError, DeepRecError, OutOfRangeError
from deeprec.graph import (CaptureError, MultiStreamOptions, colocate_with, leaf_module, mark_target_node, staged,
                           stream)
from deeprec.nn import (CBFFilter, CounterFilter, EmbeddingCollection, EmbeddingVariable, EmbeddingVariableOption,
                        GlobalStepEvict, InitializerOption, L2WeightEvict, StorageOption)
from deeprec.ops import op
from deeprec.ragged import Ragged
from deeprec.runtime import OptimizedModel, make_prefetch_hook, optimize

__version__ = "0.1.0"

from deeprec import serving  # noqa: E402  (after __version__: an export records it)
from deeprec.serving import export  # noqa: E402
__all__ = ["Ragged", "data", "errors", "models", "nn", "ops", "optim", "op", "CBFFilter", "CounterFilter",
           "EmbeddingCollection", "EmbeddingVariable", "EmbeddingVariableOption", "GlobalStepEvict",
           "InitializerOption", "L2WeightEvict", "StorageOption", "Config", "SmartStageOptions", "ThreadPoolOptions",
           "ConfigError", "DataError", "DeepRecError", "OutOfRangeError", "CaptureError",
           "leaf_module", "mark_target_node", "staged", "MultiStreamOptions", "stream", "colocate_with", "OptimizedModel", "make_prefetch_hook", "optimize", "__version__",
           "serving", "export"]
