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
`deeprec.distributed.worker.PSUpdater`.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class Updater(Protocol):
    step: int  # optimizer steps taken (restored from checkpoints)

    def before_step(self) -> None: ...

    def apply(self) -> None: ...

    def discard(self) -> None: ...

    def finish(self) -> None: ...

    def prepare_eval(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def checkpoint_dir(self, base: str) -> str: ...


class LocalUpdater:
    """Parameters in this process: torch.optim for dense ones and the row-sparse
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
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])  # EmbeddingVariables merge incremental rows
        self.optimizer.load_state_dict(state["optimizer"])

    def checkpoint_dir(self, base: str) -> str:
        return base



def make_updater(model: nn.Module, optimizer: str, lr: float, ps_addresses=(), protocol: str = "star_server",
                 sync_workers: int = 1, worker_index: int = 0, num_workers: int = 1, dense: str = "allreduce",
                 master: str | None = None, collective: bool = False, device=None,
                 micro_batches: int = 1) -> Updater:
    """Local training, a parameter-server worker when `ps_addresses` are given, or a rank of
    collective training (the model's embedding lookups are then swapped for remote or sharded
    ones: call before `optimize`). `device`: collective training places the model itself (dense
    layers before the all-reduce starts, then this rank's shards); the others leave it to the caller."""
    if collective:
        from deeprec.distributed.collective import CollectiveUpdater

        return CollectiveUpdater(model, optimizer, lr, worker_index, num_workers, device or torch.device("cpu"),
                                 overlap=micro_batches == 1)  # micro-batches: all-reduce after the last backward
    if not ps_addresses:
        from deeprec.optim import make_optimizer

        return LocalUpdater(model, make_optimizer(model, optimizer, lr))
    from deeprec.distributed import PSClient
    from deeprec.distributed.worker import PSUpdater

    return PSUpdater(model, PSClient(list(ps_addresses), protocol), optimizer, lr, sync_workers=sync_workers,
                     worker_index=worker_index, num_workers=num_workers, dense=dense, master=master)


__all__ = ["Updater", "LocalUpdater", "make_updater"]
