"""deeprec: DeepRec's training system for PyTorch users.

    import deeprec as dr
    model = dr.models.build_model("dlrm")
    reader = dr.data.CriteoReader("day_0.tsv", batch_size=512)
"""
from deeprec import data, errors, models, ops
from deeprec.errors import ConfigError, DataError, DeepRecError, OutOfRangeError
from deeprec.ops import op

__version__ = "0.1.0"
__all__ = ["data", "errors", "models", "ops", "op", "ConfigError", "DataError", "DeepRecError",
           "OutOfRangeError", "__version__"]
