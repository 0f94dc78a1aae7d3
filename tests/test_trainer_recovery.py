"""An error between two steps (a checkpoint's, an export's, an evaluation's, e.g. a PS restart seen by a
checkpoint's snapshot) goes to the strategy's recovery as a step's error does: training goes on from the
step the strategy restored and ends at exactly --steps; an error it does not recover is raised as itself."""
import traceback

import pytest
import torch

from deeprec.checkpoint import checkpoint_step, list_checkpoints, load_checkpoint
from deeprec.trainer import Trainer, TrainConfig


class Lost(Exception):
    """Stands for an error the strategy recovers from (PSRolledBack)."""


def trainer(sample, directory, fail_at=None, restore=None):
    """A 10-step run checkpointing every 5 whose _after_step raises Lost once at `fail_at` (after its
    save); recovery restores the checkpoint of step `restore` (None: the strategy does not recover)."""
    cfg = TrainConfig.create(data=[sample], batch_size=64, steps=10, progress=False, threads=1,
                             checkpoint={"dir": str(directory), "every": 5})
    t = Trainer(cfg)
    after_step, recovered = t._after_step, []

    def after_step_failing(progress):
        after_step(progress)
        if t.step == fail_at and not recovered:
            recovered.append(None)
            raise Lost(f"lost at step {t.step}")

    def recover(_trainer, err):
        if restore is None or not isinstance(err, Lost):
            return False
        path = next(p for p in list_checkpoints(str(directory)) if checkpoint_step(p) == restore)
        state = load_checkpoint(path)
        t.updater.load_state_dict(state)
        t.go_on_from(state["reader"], state)
        recovered[-1] = t.step
        return True

    t._after_step, t.strategy.recover = after_step_failing, recover
    return t, recovered


def flat(state, prefix=""):
    """A (nested) state dict as {dotted name: tensor or value}, tensors copied."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + str(key)] = value.clone() if torch.is_tensor(value) else value
    return out


@pytest.fixture
def uninterrupted(sample, tmp_path):
    t, _ = trainer(sample, tmp_path / "uninterrupted")
    assert t.train()["steps"] == 10
    return flat(t.model.state_dict())


@pytest.mark.parametrize("fail_at, restore", [(10, 10), (10, 5), (5, 5)])
def test_a_recovery_between_steps_goes_on_from_the_restored_step_and_ends_at_steps(
        sample, tmp_path, uninterrupted, fail_at, restore):
    t, recovered = trainer(sample, tmp_path / "run", fail_at, restore)
    result = t.train()
    assert recovered == [restore]
    assert result["steps"] == t.step == 10  # restored onto the last step: no step past --steps
    assert [checkpoint_step(p) for p in list_checkpoints(str(tmp_path / "run"))] == [5, 10]
    state = flat(t.model.state_dict())
    assert state.keys() == uninterrupted.keys()
    for name, value in state.items():  # the redone steps are the uninterrupted run's
        assert torch.equal(value, uninterrupted[name]) if torch.is_tensor(value) else value == uninterrupted[name], name


def test_an_error_the_strategy_does_not_recover_is_raised_as_itself(sample, tmp_path):
    t, _ = trainer(sample, tmp_path, fail_at=5, restore=None)
    with pytest.raises(Lost, match="lost at step 5") as raised:
        t.train()
    frames = [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert "after_step_failing" in frames  # where it was raised, not only where it was re-thrown
    assert raised.value.__context__ is None
