"""Evaluation in bounded memory: AUC and log loss accumulated batch by batch.

    batch ──model──> logits ──p = sigmoid──> histogram of p per class (BINS bins of [0, 1])
                                       └──> sum of the log loss (float64)

AUC is read off the two histograms: a positive ranks above every negative of a lower
bin and half above those of its own bin. Only pairs inside one bin can be wrong, so
the error is at most `auc_error_bound` = 0.5 * sum_b pos_b * neg_b / (P * N), which is
reported with the AUC (about 1e-6 on Criteo-like predictions; 0 when no bin holds both
classes). Memory: 2 x BINS int64 per task (16 MiB), whatever the number of rows.
Log loss is exact, computed as scikit-learn's log_loss (p clipped to [eps, 1 - eps]).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deeprec.progress import progress as show_progress

BINS = 1 << 20


class StreamingMetrics:
    """AUC (bucketed, error bound stated) and log loss of one binary task."""

    def __init__(self, bins: int = BINS):
        self.bins = bins
        self.pos = np.zeros(bins, dtype=np.int64)
        self.neg = np.zeros(bins, dtype=np.int64)
        self.loss_sum, self.rows = 0.0, 0

    def update(self, labels: np.ndarray, logits: np.ndarray) -> None:
        y = labels.astype(np.float64) >= 0.5
        p = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
        where = np.minimum((p * self.bins).astype(np.int64), self.bins - 1)
        self.pos += np.bincount(where[y], minlength=self.bins)
        self.neg += np.bincount(where[~y], minlength=self.bins)
        eps = np.finfo(np.float64).eps  # scikit-learn's log_loss clipping
        clipped = np.clip(p, eps, 1 - eps)
        self.loss_sum += float(-(np.log(clipped[y]).sum() + np.log1p(-clipped[~y]).sum()))
        self.rows += len(y)

    def result(self) -> dict:
        positives, negatives = int(self.pos.sum()), int(self.neg.sum())
        pairs = positives * negatives
        if pairs:
            below = np.cumsum(self.neg) - self.neg  # negatives in lower bins
            auc = float((self.pos * (below + 0.5 * self.neg)).sum() / pairs)
            bound = float(0.5 * (self.pos * self.neg).sum() / pairs)
        else:  # undefined for one class
            auc, bound = float("nan"), 0.0
        logloss = self.loss_sum / self.rows if self.rows else float("nan")
        return {"auc": auc, "auc_error_bound": bound, "logloss": logloss}


class Evaluation:
    """StreamingMetrics of every task of a model: fed batch by batch, summed across ranks."""

    def __init__(self, model: torch.nn.Module):
        self.names = tuple(getattr(model, "label_columns", ("label",)))
        self.metrics = [StreamingMetrics() for _ in self.names]

    def update(self, batch: dict, logits: torch.Tensor) -> None:
        logits = (logits if logits.dim() == 2 else logits.unsqueeze(1)).detach().float().cpu().numpy()
        for k, name in enumerate(self.names):
            self.metrics[k].update(batch[name].cpu().numpy(), logits[:, k])

    def all_reduce(self, group=None, device: torch.device | None = None) -> None:
        """Every rank's histograms and sums added up (torch.distributed; `device`: the group's, a GPU
        under NCCL), so each holds the whole."""
        import torch.distributed as dist

        for m in self.metrics:
            counts = torch.from_numpy(np.stack([m.pos, m.neg])).to(device)
            sums = torch.tensor([m.loss_sum, float(m.rows)], dtype=torch.float64, device=device)
            dist.all_reduce(counts, group=group)
            dist.all_reduce(sums, group=group)
            counts, sums = counts.cpu(), sums.cpu()
            m.pos, m.neg = counts[0].numpy(), counts[1].numpy()
            m.loss_sum, m.rows = float(sums[0]), int(sums[1])

    def result(self) -> dict:
        rows = self.metrics[0].rows
        if not rows:
            return {"rows": 0, "auc": float("nan"), "logloss": float("nan")}
        tasks = {name: m.result() for name, m in zip(self.names, self.metrics)}
        result = {"rows": rows, **tasks[self.names[0]]}
        if len(self.names) > 1:
            result["tasks"] = tasks
        return result


@dataclass(frozen=True)
class Uncounted:
    """A batch the model runs on but the metrics do not count. Lockstep evaluation (collective
    training) yields these: a rank whose share has ended runs its last batch again, so that the
    other ranks' lookups, which exchange ids with it, get their answers."""

    batch: dict


@torch.no_grad()
def run_evaluation(model: torch.nn.Module, batches, *, progress=None, description: str = "evaluate",
                   on_logits=None) -> Evaluation:
    """The evaluation loop: `model` in eval mode (its mode restored after) over one pass of
    `batches`, each batch's predictions counted into an Evaluation (an `Uncounted` batch only runs).
    `progress`: rows evaluated and rows/s shown on a terminal (None or True: deeprec.progress's
    shared console, False: never, or a rich Console). `on_logits(logits)`: called with each counted
    batch's logits, in order (per-row predictions: `deeprec evaluate --predictions`)."""
    evaluation = Evaluation(model)
    rows = evaluation.metrics[0]  # its row count grows with every batch
    was_training = model.training
    model.eval()
    try:
        with show_progress(description, unit="rows", console=progress, transient=True) as shown:
            for batch in batches:
                if isinstance(batch, Uncounted):
                    model(batch.batch)
                    continue
                before = rows.rows
                logits = model(batch)["logits"]
                evaluation.update(batch, logits)
                if on_logits is not None:
                    on_logits(logits)
                shown.advance(rows.rows - before)
    finally:
        model.train(was_training)
    return evaluation


def evaluate(model: torch.nn.Module, reader, *, progress=None, description: str = "evaluate",
             on_logits=None) -> dict:
    """AUC and log loss of the model's predictions over one pass of `reader`, in bounded
    memory (`run_evaluation`); a multi-task model (logits [B, T]) gets them per task under
    "tasks", the first task's at the top level."""
    return run_evaluation(model, reader, progress=progress, description=description, on_logits=on_logits).result()
