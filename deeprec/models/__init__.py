"""Model zoo: plain `nn.Module`s whose `forward(raw_batch)` returns {"loss", "logits"}."""
from __future__ import annotations

from deeprec.models.deepfm import DeepFM, DeepFMConfig
from deeprec.models.dlrm import DLRM, DLRMConfig
from deeprec.models.wdl import WDL, WDLConfig

MODELS = {"dlrm": (DLRM, DLRMConfig), "deepfm": (DeepFM, DeepFMConfig), "wdl": (WDL, WDLConfig)}


def build_model(name: str, **overrides):
    """Model by name with its default config, fields overridden by keyword."""
    from deeprec.errors import check_choice

    check_choice("model", name, tuple(MODELS))
    cls, config_cls = MODELS[name]
    return cls(config_cls(**overrides))


__all__ = ["DLRM", "DLRMConfig", "DeepFM", "DeepFMConfig", "WDL", "WDLConfig", "MODELS", "build_model"]
