"""Who updates the parameters after each backward: one owner per training step.

    trainer ──> fast.train_steps(reader, updater):
                  updater.before_step()      local: nothing      PS: sync barrier, pull dense
                  forward + backward         (micro-batches accumulate; embedding rows may update
                                              fused inside backward, or be kept until apply)
                  updater.apply()            local: optimizer.step() (dense + kept embedding rows)
                                             PS: one push of every gradient (dense="allreduce":
                                             dense gradients all-reduced, local optimizer step)
    end:          updater.finish()           PS: send a push still held back (star_server_lite),
                                             leave the all-reduce once every worker has ended
    evaluation:   updater.prepare_eval()     PS: pull the dense parameters (dense="ps")
    checkpoints:  updater.state_dict() / load_state_dict()   local: model + optimizer; PS: snapshot

`LocalUpdater` is the single-process implementation; the parameter-server one is
`deeprec.distributed.ps.worker.PSUpdater`, the collective one `deeprec.distributed.collective.sharded.CollectiveUpdater`
(a LocalUpdater with a dense all-reduce before the step). Each Strategy (deeprec.runtime.strategy)
builds its own.
"""
from __future__ import annotations

from typing import Protocol

from torch import nn

from deeprec.nn.shared import state_once, state_under_every_name


class Updater(Protocol):
    step: int  # optimizer steps taken (restored from checkpoints)

    def before_step(self) -> None: ...

    def apply(self) -> None: ...

    def discard(self) -> None: ...

    def finish(self) -> None: ...

    def prepare_eval(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class LocalUpdater:
    """Parameters in this process: DenseOptimizer (fused) for dense ones and the row-sparse
    optimizers attached to the embeddings (`deeprec.optim.make_optimizer`)."""

    def __init__(self, model: nn.Module, optimizer):
        self.model, self.optimizer, self.step = model, optimizer, 0

    def before_step(self) -> None:
        pass

    def apply(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.step += 1

    def discard(self) -> None:
        """Drop this step's gradients (a non-finite loss): nothing is updated."""
        self.optimizer.zero_grad()

    def finish(self) -> None:
        pass

    def prepare_eval(self) -> None:
        pass

    def state_dict(self) -> dict:
        # a module under several names (an EV shared by two features): its rows saved once
        return {"model": state_once(self.model, self.model.state_dict()), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        # EmbeddingVariables merge incremental rows; a shared module's other names from its first
        self.model.load_state_dict(state_under_every_name(self.model, state["model"]))
        self.optimizer.load_state_dict(state["optimizer"])


__all__ = ["Updater", "LocalUpdater"]
