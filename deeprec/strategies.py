"""Every way of training side by side, for what must tell them apart from the outside: reading any
checkpoint as a one-process model (`deeprec evaluate`, `deeprec export`).

    checkpoint file or folder ──> Collective.read_one_process        rank-R-of-N folders, merged
                                  ParameterServer.read_one_process   a PS job's chief (a worker's: refused)
                                  LocalStrategy.read_one_process     one process's file
                              ──> the model it names, built ──> its strategy's one_process_weights loaded

Each strategy knows its own checkpoint folder (deeprec.runtime.strategy.Strategy.read_one_process);
this module only knows which strategies there are. It sits above deeprec.runtime and
deeprec.distributed, which import nothing from it, so the arrows all point down.
"""
from __future__ import annotations

import os

from deeprec.checkpoint import load_model_weights
from deeprec.distributed.collective.strategy import Collective
from deeprec.distributed.ps.strategy import ParameterServer
from deeprec.errors import ConfigError
from deeprec.runtime.strategy import LocalStrategy, OneProcessCheckpoint, SavedCheckpoint

STRATEGIES = (Collective, ParameterServer, LocalStrategy)  # asked in order: LocalStrategy takes any one-file one


def read_one_process(checkpoint: str) -> OneProcessCheckpoint:
    """The checkpoint file or folder `checkpoint`, read as one process's by the strategy that wrote it."""
    if not os.path.exists(checkpoint):
        raise ConfigError(f"--checkpoint {checkpoint}: no such file or folder")
    saved = SavedCheckpoint(checkpoint)
    for strategy in STRATEGIES:
        found = strategy.read_one_process(saved)
        if found is not None:
            return found
    raise ConfigError(f"--checkpoint {checkpoint}: no checkpoint found (give a checkpoint file, or the "
                      "--checkpoint-dir folder of a training run)")


def model_from_checkpoint(checkpoint: str, model_spec: str | None = None):
    """(model with the checkpoint's weights, its state, its schema, where it came from) from a checkpoint
    file or folder: one process's, a parameter-server job's (the chief's, with every PS's rows) or a
    collective job's (rank-R-of-N folders, merged). `model_spec`: build this model instead of the one
    the checkpoint names (a model trained from Python, or a file that moved)."""
    from deeprec.data import schema_from_dict
    from deeprec.models.spec import load_model

    found = read_one_process(checkpoint)
    state = found.state
    schema = schema_from_dict(state["schema"]) if state.get("schema") else None
    model = load_model(model_spec or state["model_name"], schema, **state["model_overrides"])
    load_model_weights(model, found.weights(model))
    return model, state, schema, found.source


__all__ = ["STRATEGIES", "read_one_process", "model_from_checkpoint"]
