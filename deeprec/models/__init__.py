"""Model zoo: plain `nn.Module`s whose `forward(raw_batch)` returns {"loss", "logits"}.

DLRM, DeepFM and WDL read the Criteo columns; DIN, DIEN, DSSM and MMoE read any
schema's columns (deeprec.data.Schema: roles, sequences, labels).
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
SCHEMA_MODELS = ("din", "dien", "dssm", "mmoe")  # built over a dataset schema
DEFAULT_PRESET = {"din": "behavior", "dien": "behavior", "dssm": "behavior", "mmoe": "byterec"}


def build_model(name: str, schema=None, **overrides):
    """Model by name with its default config, fields overridden by keyword; the
    schema models take `schema` (a Schema; default: their synthetic/real preset)."""
    from deeprec.errors import ConfigError, check_choice

    check_choice("model", name, tuple(MODELS))
    cls, config_cls = MODELS[name]
    try:
        config = config_cls(**overrides)
    except TypeError as err:
        raise ConfigError(f"model {name!r}: {err}") from None
    if name in SCHEMA_MODELS:
        return cls(config, schema=schema)
    if schema is not None and getattr(schema, "name", "Criteo") != "Criteo":
        raise ConfigError(f"model {name!r} reads the Criteo columns; for {schema.name} data use one of "
                          f"{', '.join(SCHEMA_MODELS)}")
    return cls(config)


__all__ = ["DLRM", "DLRMConfig", "DeepFM", "DeepFMConfig", "WDL", "WDLConfig", "DIN", "DINConfig", "DIEN",
           "DIENConfig", "DSSM", "DSSMConfig", "MMoE", "MMoEConfig", "MODELS", "SCHEMA_MODELS", "build_model"]
