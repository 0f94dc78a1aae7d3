"""Model zoo: plain `nn.Module`s whose `forward(raw_batch)` returns {"loss", "logits"}.

Every model reads its columns from a schema (deeprec.data.Schema) through one
feature layer (deeprec.models.features.FeatureEmbedder); the default schema is
Criteo's for DLRM, DeepFM and WDL, the synthetic behaviour data's for DIN, DIEN
and DSSM, ByteRec's for MMoE.
"""
from __future__ import annotations

from deeprec.models.deepfm import DeepFM, DeepFMConfig
from deeprec.models.dien import DIEN, DIENConfig
from deeprec.models.din import DIN, DINConfig
from deeprec.models.dlrm import DLRM, DLRMConfig
from deeprec.models.dssm import DSSM, DSSMConfig
from deeprec.models.mmoe import MMoE, MMoEConfig
from deeprec.models.wdl import WDL, WDLConfig

MODELS = {"dlrm": (DLRM, DLRMConfig), "deepfm": (DeepFM, DeepFMConfig), "wdl": (WDL, WDLConfig),
          "din": (DIN, DINConfig), "dien": (DIEN, DIENConfig), "dssm": (DSSM, DSSMConfig), "mmoe": (MMoE, MMoEConfig)}


def build_model(name: str, schema=None, **overrides):
    """Model by name with its default config, fields overridden by keyword, over
    `schema` (a Schema; default: the model's preset)."""
    from deeprec.errors import ConfigError, check_choice

    check_choice("model", name, tuple(MODELS))
    cls, config_cls = MODELS[name]
    try:
        config = config_cls(**overrides)
    except TypeError as err:
        raise ConfigError(f"model {name!r}: {err}") from None
    return cls(config, schema=schema)


__all__ = ["DLRM", "DLRMConfig", "DeepFM", "DeepFMConfig", "WDL", "WDLConfig", "DIN", "DINConfig", "DIEN",
           "DIENConfig", "DSSM", "DSSMConfig", "MMoE", "MMoEConfig", "MODELS", "build_model"]
