"""A failure keeps the work (issue 42): a run with --checkpoint-dir that ends on an error saves its last
completed step first (the reader's position before the failing batch), so --resume goes on exactly;
background writers (--log-dir, --export-dir) hand their errors to the trainer as one line; --follow
checkpoints every 1000 steps unless told otherwise.

Full disks are small tmpfs mounts, filled up to the room a case needs (needs root or CAP_SYS_ADMIN);
where none can be mounted those tests skip, saying why.
"""
import os
import subprocess

import pytest
import torch

from deeprec.checkpoint import list_checkpoints, load_checkpoint
from deeprec.cli import main
from deeprec.data import resolve_schema
from deeprec.errors import CheckpointError, ConfigError, DataError, ExportError, NonFiniteError
from deeprec.models.spec import load_model
from deeprec.runlog import RunLog
from deeprec.serving.online import ExportWriter
from deeprec.train_config import FOLLOW_CHECKPOINT_EVERY, TrainConfig
from deeprec.trainer import Trainer, train
from output import line_with

# the reader parses 4 MiB chunks (about 16,000 of these rows) whole: the bad row sits in the second chunk, so
# the steps before it are the first chunk's whole batches (about 31)
BATCH, ROWS, BAD_ROW, STEPS = 512, 20_000, 17_000, 40
SMALL = {"hash_buckets": 100, "embedding": "table", "bottom_mlp": (16,), "top_mlp": (8,)}


def _fill(folder, room: int) -> None:
    """Fill the filesystem of `folder` up to about `room` bytes left (a file .filler in it)."""
    fd = os.open(os.path.join(folder, ".filler"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError:
        pass
    os.ftruncate(fd, max(0, os.fstat(fd).st_size - room) // 4096 * 4096)
    os.close(fd)


@pytest.fixture
def full_fs(tmp_path):
    """full_fs(room) -> a folder on a fresh 4 MiB tmpfs with about `room` bytes left (None: empty);
    unmounted after the test; skips where no tmpfs can be mounted."""
    mounted = []

    def mount(room: int | None, name: str = "fs"):
        target = tmp_path / name
        target.mkdir()
        why = "not root" if os.geteuid() != 0 else None
        if why is None:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(target)],
                                  capture_output=True, text=True)
            why = None if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")
        if why is not None:
            pytest.skip(f"cannot mount a small tmpfs for a disk that fills up ({why})")
        mounted.append(target)
        if room is not None:
            _fill(target, room)
        return target
    yield mount
    for target in mounted:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


@pytest.fixture(scope="module")
def bad_tsv(tmp_path_factory, sample_rows):
    """ROWS Criteo rows; row BAD_ROW (0-based; line BAD_ROW + 1) has I1 = 'x'."""
    path = tmp_path_factory.mktemp("bad") / "bad.tsv"
    rows = [list(sample_rows[k % len(sample_rows)]) for k in range(ROWS)]
    rows[BAD_ROW][1] = "x"
    path.write_text("".join("\t".join(r) + "\n" for r in rows))
    return str(path)


def _cfg(data, ckpt, **kw):
    return TrainConfig.create(**{**dict(model="dlrm", data=[data], batch_size=BATCH, seed=3, progress=False,
                                        checkpoint_dir=str(ckpt), model_overrides=SMALL), **kw})


def _cli(tmp_path, data, *flags) -> list[str]:
    config = tmp_path / "small.toml"
    config.write_text("[model_overrides]\nhash_buckets = 100\nbottom_mlp = [16]\ntop_mlp = [8]\n")
    return ["train", "--config", str(config), "--embedding", "table", "--data", data, "--batch-size", str(BATCH),
            "--no-progress", *flags]


def _done_before(err) -> int:
    """The steps done before the failing batch, from the error's checkpoint; checked to be some, and to
    hold no row from the bad row on."""
    done = int(os.path.basename(err.checkpoint)[len("checkpoint-"):-len(".pt")])
    assert 0 < done and done * BATCH <= BAD_ROW
    return done


def _same_checkpoint(a: str, b: str) -> None:
    a, b = load_checkpoint(a), load_checkpoint(b)
    assert a["step"] == b["step"] and a["reader"] == b["reader"]
    torch.testing.assert_close(a["model"], b["model"], rtol=0, atol=0)  # exactly


# -- a failure checkpoints first ------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("smart_stage", [False, True])
def test_a_bad_row_saves_the_step_before_it_and_resume_goes_on_exactly(tmp_path, bad_tsv, smart_stage):
    ckpt, steps = tmp_path / "failed", STEPS
    with pytest.raises(DataError) as failed:
        train(_cfg(bad_tsv, ckpt, steps=steps, on_bad_row="raise", smart_stage=smart_stage))
    done = _done_before(failed.value)
    saved = str(ckpt / f"checkpoint-{done:09d}.pt")
    assert str(failed.value) == (f"{bad_tsv}:{BAD_ROW + 1}: column I1: 'x' is not a number; saved step {done}: "
                                 f"{saved} (continue with --resume)")
    assert failed.value.checkpoint == saved and list_checkpoints(str(ckpt)) == [saved]
    state = load_checkpoint(saved)
    assert state["step"] == done and state["reader"]["batches"] == done  # the position before the failing batch
    # go on past the row (skip it) from there: the same as a run that skipped it from the start
    train(_cfg(bad_tsv, ckpt, steps=steps, on_bad_row="skip", smart_stage=smart_stage, resume=True))
    whole = tmp_path / "whole"
    train(_cfg(bad_tsv, whole, steps=steps, on_bad_row="skip", smart_stage=smart_stage))
    last = f"checkpoint-{steps:09d}.pt"
    _same_checkpoint(str(ckpt / last), str(whole / last))


def test_a_non_finite_loss_saves_the_step_before_it(tmp_path, sample):
    trainer = Trainer(_cfg(sample, tmp_path, steps=6, batch_size=32, on_nan="raise"))
    to_batch, count = trainer.train_reader._to_batch, [0]

    def poisoned(*rows):  # the third batch holds an inf
        batch = to_batch(*rows)
        count[0] += 1
        if count[0] == 3:
            batch["I2"][0] = float("inf")
        return batch

    trainer.train_reader._to_batch = poisoned
    with pytest.raises(NonFiniteError, match=r"\(reader epoch 0, batch 3; the step was not applied\).*; saved step 2: "
                                             r".*checkpoint-000000002\.pt \(continue with --resume\)$"):
        trainer.train()
    state = load_checkpoint(str(tmp_path / "checkpoint-000000002.pt"))
    assert state["step"] == 2 and state["reader"]["batches"] == 2  # resume reads the poisoned batch again


def test_an_error_inside_a_step_is_not_saved(tmp_path, sample):
    # the forward failed: its lookups may have changed part of the state, so no step's state is at hand
    trainer = Trainer(_cfg(sample, tmp_path, steps=6, batch_size=32))
    to_batch, count = trainer.train_reader._to_batch, [0]

    def broken(*rows):
        batch = to_batch(*rows)
        count[0] += 1
        if count[0] == 3:
            batch["I2"] = batch["I2"][:-1]  # one value short: the model's torch.stack fails
        return batch

    trainer.train_reader._to_batch = broken
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size") as failed:
        trainer.train()
    assert "saved" not in str(failed.value) and list_checkpoints(str(tmp_path)) == []


def test_the_cli_line_says_where_the_work_is(tmp_path, bad_tsv, capsys):
    ckpt = tmp_path / "ck"
    assert main(_cli(tmp_path, bad_tsv, "--steps", str(STEPS), "--checkpoint-dir", str(ckpt))) == 1
    err = capsys.readouterr().err
    [saved] = list_checkpoints(str(ckpt))
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {bad_tsv}:{BAD_ROW + 1}: column I1: 'x' is not a number; saved step "
                      f"{load_checkpoint(saved)['step']}: {saved} (continue with --resume)"], err
    assert "Traceback" not in err


# -- full disks -----------------------------------------------------------------------------------------------
def test_a_full_checkpoint_disk_is_one_line_naming_the_last_checkpoint(tmp_path, bad_tsv, full_fs):
    room = os.path.getsize(_one_checkpoint(tmp_path, bad_tsv))
    ckpt = full_fs(int(2.5 * room))  # room for two checkpoints: the third cannot be written
    with pytest.raises(CheckpointError) as failed:
        train(_cfg(bad_tsv, ckpt, steps=9, checkpoint_every=2, on_bad_row="skip"))
    assert str(failed.value) == (f"checkpoint {ckpt}/checkpoint-000000006.pt: cannot be written (No space left on "
                                 f"device); the last checkpoint is {ckpt}/checkpoint-000000004.pt (step 4; continue "
                                 "with --resume)")
    assert sorted(os.listdir(ckpt)) == [".filler", "checkpoint-000000002.manifest.json", "checkpoint-000000002.pt",
                                        "checkpoint-000000004.manifest.json", "checkpoint-000000004.pt"]
    load_checkpoint(str(ckpt / "checkpoint-000000004.pt"))  # intact


def test_a_failure_on_a_full_checkpoint_disk_says_it_could_not_be_saved(tmp_path, bad_tsv, full_fs):
    ckpt = full_fs(0)
    with pytest.raises(DataError) as failed:
        train(_cfg(bad_tsv, ckpt, steps=STEPS, on_bad_row="raise"))
    message = str(failed.value)
    done = int(message.split("; step ")[1].split()[0])
    assert 0 < done and done * BATCH <= BAD_ROW
    assert message.endswith(f"'x' is not a number; step {done} could not be saved (checkpoint {ckpt}/"
                            f"checkpoint-{done:09d}.pt: cannot be written (No space left on device)); there is no "
                            "checkpoint")
    assert failed.value.checkpoint is None
    assert os.listdir(ckpt) == [".filler"]  # no part of it left


def _one_checkpoint(tmp_path, data) -> str:
    train(_cfg(data, tmp_path / "size", steps=1, on_bad_row="skip"))
    return str(tmp_path / "size" / "checkpoint-000000001.pt")


def test_a_full_log_disk_warns_once_and_the_run_goes_on(tmp_path, bad_tsv, full_fs, capsys):
    logs = full_fs(8192)
    assert main(_cli(tmp_path, bad_tsv, "--steps", "100", "--on-bad-row", "skip", "--log-dir", str(logs / "run"),
                     "--log-every", "1", "--checkpoint-dir", str(tmp_path / "ck"))) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "--log-dir" in line]
    assert warned == [f"warning: --log-dir {logs}/run: cannot write TensorBoard events (No space left on device): "
                      "logging is off for the rest of the run; training goes on"], err
    assert "Traceback" not in err and "internal error" not in err
    assert list_checkpoints(str(tmp_path / "ck"))[-1].endswith("checkpoint-000000100.pt")


def test_runlog_turns_off_after_one_failed_write(full_fs):
    lines = []
    runlog = RunLog(str(full_fs(4096)), None, every=1, warn=lines.append)
    step = 0
    while runlog.failed is None and step < 10_000:  # until the disk is full (a write fails)
        step += 1
        runlog.step(step, 0.5, 32)
        runlog.evaluation(step, {"auc": 0.5, "logloss": 0.7})  # flushes: the writer thread's error comes back
    assert runlog.failed is not None and runlog.failed.errno == 28
    for more in range(step + 1, step + 50):  # nothing more is written, nothing is raised
        runlog.step(more, 0.5, 32)
    runlog.evaluation(step + 50, {"auc": 0.5})
    runlog.close()
    assert len(lines) == 1 and "No space left on device" in lines[0]
    full = full_fs(0, "full")  # full from the start: refused before training, naming the flag
    with pytest.raises(ConfigError, match=rf"^--log-dir {full}: cannot write TensorBoard events in {full}: No space"):
        RunLog(str(full), None, every=1)


@pytest.mark.slow
def test_a_full_export_disk_ends_the_run_after_its_checkpoint(tmp_path, bad_tsv, full_fs):
    exports, ckpt = full_fs(4096), tmp_path / "ck"
    with pytest.raises(ExportError) as failed:
        train(_cfg(bad_tsv, ckpt, steps=9, on_bad_row="skip", export_dir=str(exports), export_every=3,
                   export_compile=False))
    assert str(failed.value) == (f"--export-dir {exports}: the export of step 3 cannot be written (No space left on "
                                 f"device); saved step 3: {ckpt}/checkpoint-000000003.pt (continue with --resume)")
    assert os.listdir(exports) == [".filler"]  # the failed export left no staging folder


@pytest.mark.slow
def test_a_delta_on_a_full_disk_is_an_export_error_and_leaves_nothing(full_fs, sample):
    schema = resolve_schema([sample])
    exports = full_fs(None)
    writer = ExportWriter(str(exports), load_model("dlrm", schema, **SMALL), schema, "dlrm", compile=False)
    writer.full(1)
    before = sorted(os.listdir(exports))
    _fill(exports, 0)
    with pytest.raises(ExportError, match=rf"^--export-dir {exports}: the export of step 2 cannot be written \(No "
                                          r"space left on device\)$"):
        writer.delta(2)
    assert sorted(os.listdir(exports)) == sorted(before + [".filler"]) and writer.last_step == 1



def test_a_new_export_writer_sweeps_what_killed_writes_left(tmp_path, sample):
    # a delta's temporary, safetensors' own temporary inside it (Rust's tempfile), a staging folder, a set-aside
    # full export; the served exports, deltas and other names stay
    left = [".delta-7.safetensors-x1y2.tmp", ".delta-7.json-a.tmp", ".tmpAXRD87", ".export-q9", "full-000000005.old-1"]
    kept = ["full-000000005", "delta-000000006.json", "delta-000000006.safetensors", ".tmpfile-of-a-user", "notes"]
    for name in left + kept:
        if name.startswith((".export-", "full-")):
            (tmp_path / name).mkdir()
            (tmp_path / name / "program.pt2").write_bytes(b"x")
        else:
            (tmp_path / name).write_bytes(b"x")
    schema = resolve_schema([sample])
    ExportWriter(str(tmp_path), load_model("dlrm", schema, **SMALL), schema, "dlrm", compile=False)
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


def test_deeprec_export_onto_a_full_disk_is_one_line_naming_out(tmp_path, bad_tsv, full_fs, capsys):
    checkpoint = _one_checkpoint(tmp_path, bad_tsv)
    out = full_fs(4096) / "exp"
    capsys.readouterr()
    assert main(["export", "--checkpoint", checkpoint, "--out", str(out), "--no-compile"]) == 1
    err = capsys.readouterr().err
    assert line_with(err, f"--out {out}: the export of step 1 cannot be written (No space left on device)")
    assert "Traceback" not in err and "internal error" not in err
    assert not os.path.exists(out)  # no half export

# -- --follow keeps the work by default --------------------------------------------------------------------------
def test_follow_checkpoints_every_1000_steps_unless_told(tmp_path, capsys):
    data = str(tmp_path)
    assert FOLLOW_CHECKPOINT_EVERY == 1000
    assert TrainConfig.create(data=[data], follow=True, checkpoint_dir="ck").checkpoint.every == 1000
    assert TrainConfig.create(data=[data], follow=True, checkpoint={"dir": "ck", "every": 0}).checkpoint.every == 0
    assert TrainConfig.create(data=[data], follow=True, checkpoint_every=50).checkpoint.every == 50
    assert TrainConfig.create(data=[data], checkpoint_dir="ck").checkpoint.every == 0  # saved at its end
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "(default: 1000 under --follow, else 0)" in " ".join(capsys.readouterr().out.split())
