"""SmartStage executor="auto": whatever it picks, every batch trains once, in order, with the same math."""
import pytest
import torch
from torch import nn

import deeprec as dr
from deeprec import ops
from deeprec.data import CriteoReader
from deeprec.runtime import auto_stage


class Rows(nn.Module):
    """Hashes the unique row id C1 (staged) and trains a tiny table on it."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(1000, 4)

    def forward(self, batch):
        ids = ops.string_to_hash_key(batch["C1"])
        logits = self.table(ids % 1000).sum(1) + ops.fill_missing(batch["I1"])
        return {"loss": nn.functional.binary_cross_entropy_with_logits(logits, batch["label"]), "logits": logits,
                "ids": ids}


def _run(fast, reader):
    ids, states, losses = [], [], []
    for out in fast.iterate(reader, backward=True):
        ids.append(out["ids"])
        losses.append(float(out["loss"]))
        states.append(fast.last_source_state)
    return torch.cat(ids).tolist(), states, losses


@pytest.mark.slow
@pytest.mark.parametrize("forced", ["off", "thread", "process"])
def test_auto_trains_every_batch_once_whatever_it_picks(unique_tsv, monkeypatch, forced):
    # Thresholds forced so each branch (and its drain and switch) runs on this machine.
    monkeypatch.setattr(auto_stage, "TRY_BELOW", 0.0 if forced == "off" else float("inf"))
    monkeypatch.setattr(auto_stage, "KEEP_BELOW", float("inf") if forced != "off" else 0.0)
    monkeypatch.setattr(auto_stage, "GIL_EXCESS", 0.0 if forced == "process" else float("inf"))
    torch.manual_seed(0)
    plain_model = Rows()
    torch.manual_seed(0)
    model = Rows()
    fast = dr.optimize(model, dr.Config(smart_stage=True, smart_stage_options=dr.SmartStageOptions(
        capacity=2, executor="auto")))
    reader = CriteoReader(unique_tsv, 200)
    got_ids, got_states, _ = _run(fast, reader)
    plain_reader = CriteoReader(unique_tsv, 200)
    want_ids, want_states = [], []
    for batch in plain_reader:
        want_ids += ops.string_to_hash_key(batch["C1"]).tolist()
        want_states.append(plain_reader.state_dict())
    assert got_ids == want_ids  # 50 batches: calibration, trials and the rest, none lost or repeated
    assert got_states == want_states  # checkpoints record the right reader position throughout
    stats = fast.prefetch_stats  # one count across the phases, inline ones too (--log-dir's time/stage_ms)
    assert stats.taken == len(want_states) and stats.stage_seconds > 0 and stats.dropped == 0
    decision = fast.auto_decision
    assert decision.executor == forced and decision.reason and forced in decision.summary()
    if forced != "off":
        assert "thread" in decision.ms
    if forced == "process":
        assert "process" in decision.ms
    assert forced in fast.explain()


def test_auto_math_equals_the_plain_loop(unique_tsv, monkeypatch):
    monkeypatch.setattr(auto_stage, "TRY_BELOW", float("inf"))
    monkeypatch.setattr(auto_stage, "KEEP_BELOW", float("inf"))
    monkeypatch.setattr(auto_stage, "GIL_EXCESS", float("inf"))
    losses = {}
    for name, cfg in (("plain", dr.Config()), ("auto", dr.Config(smart_stage=True, smart_stage_options=
                                                                  dr.SmartStageOptions(executor="auto")))):
        torch.manual_seed(0)
        model = Rows()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        fast = dr.optimize(model, cfg)
        losses[name] = []
        for out in fast.iterate(CriteoReader(unique_tsv, 500), backward=True):
            opt.step()
            opt.zero_grad()
            losses[name].append(float(out["loss"]))
    assert len(losses["auto"]) == 20
    assert losses["auto"] == pytest.approx(losses["plain"], rel=1e-6)  # intra-op threads may round differently


def test_auto_with_micro_batches_runs_the_thread_executor(unique_tsv):
    fast = dr.optimize(Rows(), dr.Config(smart_stage=True, micro_batch_num=2,
                                         smart_stage_options=dr.SmartStageOptions(executor="auto")))
    steps = sum(1 for _ in fast.iterate(CriteoReader(unique_tsv, 1000), backward=True))
    assert steps == 10 and fast.prefetch_stats.taken == 20 and fast.auto_decision is None
