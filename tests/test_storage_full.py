"""Tiered storage on a filesystem that fills up, or that cannot be written: a clear deeprec error,
never a SIGBUS. The disk tier reserves its file's blocks (posix_fallocate) before it maps them.

A small filesystem is a tmpfs mounted for the test (needs root or CAP_SYS_ADMIN); where none can be
mounted those tests skip, saying why. The file size limit (RLIMIT_FSIZE, `ulimit -f`) stands in for a
full disk in a subprocess wherever tmpfs cannot be mounted.
"""
import os
import resource
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import deeprec as dr
from deeprec.checkpoint import load_checkpoint
from deeprec.distributed.ps.tiered import TieredArena
from deeprec.distributed.ps.wire import ResourceExhausted
from deeprec.errors import ConfigError, StorageFullError
from deeprec.nn.disk_rows import DiskRows
from deeprec.optim import sparse
from test_tiered import assert_same_model

PAGE = 4096
FULL = r"no space left on .*: \d+ bytes needed"


def _mount(target, *options: str) -> None:
    os.makedirs(target, exist_ok=True)
    why = "not root" if os.geteuid() != 0 else None
    if why is None:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(target)],
                              capture_output=True, text=True)
        why = None if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")
    if why is not None:
        pytest.skip(f"cannot mount a small tmpfs for a filesystem that fills up ({why})")


@pytest.fixture
def small_fs(tmp_path):
    """mount(size_bytes) -> a tmpfs of that size (unmounted after the test); skips where none can be made."""
    mounted = []

    def mount(size: int, name: str = "fs", *options: str):
        target = tmp_path / name
        _mount(target, f"size={size}", *options)
        mounted.append(target)
        return target
    yield mount
    for target in mounted:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def _ev(path, dram_bytes=40_000):
    storage = dr.StorageOption(tiers=["dram", "ssd"], dram_bytes=dram_bytes, path=str(path))
    ev = dr.nn.embedding_variable(8, ev_option=dr.EmbeddingVariableOption(storage=storage), name="t")
    ev.set_optimizer(sparse.Adagrad(lr=0.1))
    return ev


def _fill(ev, batches=2000, width=20):
    """Look up new keys until the disk tier has no room; returns {key: value read} of the lookups that
    succeeded and the error."""
    seen = {}
    for i in range(batches):
        keys = torch.arange(i * width, (i + 1) * width)
        try:
            _, values, _ = ev.lookup(keys)
        except StorageFullError as err:
            return seen, err, keys
        seen.update(zip(keys.tolist(), values.clone()))
    raise AssertionError(f"the disk tier never filled up ({ev.tier_stats()})")


def test_full_filesystem_is_a_storage_full_error_and_keeps_every_row(small_fs):
    path = small_fs(256 * PAGE)
    ev = _ev(path)
    seen, err, failed = _fill(ev)
    assert str(err).startswith(f"no space left on {path}: ")
    assert err.path == str(path) and err.needed > 0 and "--storage-path" in str(err) and "--dram-bytes" in str(err)
    assert ev.tier_stats()["disk_rows"] > 1000  # it filled the filesystem, in bigger then smaller growths
    state = ev.export()
    assert sorted(state["keys"].tolist()) == sorted(seen)  # the failed lookup inserted nothing
    for key, value in zip(state["keys"].tolist(), state["values"]):
        assert torch.equal(value, seen[key])  # every row kept, on disk or in DRAM
    # rows already held still read and train: the lookups that need no new disk room succeed
    _, again, _ = ev.lookup(torch.tensor(list(seen)[-10:]))
    assert torch.equal(again, torch.stack([seen[k] for k in list(seen)[-10:]]))
    with pytest.raises(StorageFullError):
        ev.lookup(failed)
    del ev


def test_disk_rows_reserve_their_blocks_and_change_nothing_when_full(small_fs):
    path = small_fs(64 * PAGE)
    rows = DiskRows(str(path), "t", 30)  # 144-byte records: 1024 of them reserved up front
    assert os.statvfs(path).f_bfree * PAGE <= 64 * PAGE - 1024 * rows.record_bytes  # reserved, not sparse
    rows.allocate(1024)
    with pytest.raises(StorageFullError, match=FULL) as err:
        rows.allocate(10_000)
    assert err.value.needed == (11_024 - 1024) * rows.record_bytes
    assert rows.size == 1024 and rows.capacity >= 1024  # unchanged
    rows.release(torch.arange(10))
    assert rows.allocate(10).tolist() == list(range(10))  # freed slots need no room
    rows.close()


@pytest.mark.slow
def test_file_size_limit_is_a_storage_full_error(tmp_path):
    """RLIMIT_FSIZE (SIGXFSZ ignored, as a service would) makes a full disk without root."""
    script = textwrap.dedent(f"""
        import resource, signal, sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_storage_full import _ev, _fill
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        seen, err, _ = _fill(_ev({str(tmp_path)!r}))
        print(err)
    """)
    if resource.getrlimit(resource.RLIMIT_FSIZE)[1] not in (resource.RLIM_INFINITY,) and \
            resource.getrlimit(resource.RLIMIT_FSIZE)[1] < (1 << 20):
        pytest.skip("the hard file size limit is below the 1 MiB this test sets")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"no space left (the file size limit, ulimit -f, is reached) on {tmp_path}: ")
    assert done.stdout.count("\n") == 1


def _read_only_folder(tmp_path, small_fs):
    if os.geteuid() == 0:
        return small_fs(PAGE, "ro", "ro")  # root writes through permissions: a read-only mount
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


def test_unusable_storage_path_is_a_config_error_naming_the_flag(tmp_path, small_fs):
    (tmp_path / "file").write_text("x")
    ro = _read_only_folder(tmp_path, small_fs)
    for path, what in [(tmp_path / "file", "is not a folder"), (tmp_path / "file" / "sub", "is not a folder"),
                       (ro, "is on a read-only filesystem" if os.geteuid() == 0 else "is not writable"),
                       (ro / "missing", "does not exist and cannot be created")]:
        with pytest.raises(ConfigError) as err:
            _ev(path)
        assert str(err.value).startswith(f"--storage-path {str(path)!r} {what}"), err.value
        assert "\n" not in str(err.value)
    # a missing folder that can be made is made (as before)
    _ev(tmp_path / "new" / "tier")
    assert (tmp_path / "new" / "tier").is_dir()


def test_ps_arena_answers_resource_exhausted(tmp_path, small_fs):
    storage = dr.StorageOption(tiers=["dram", "ssd"], dram_bytes=20_000, path=str(_read_only_folder(tmp_path, small_fs)))
    with pytest.raises(ResourceExhausted, match="--storage-path"):
        TieredArena(8, sparse.Adagrad(lr=0.1), storage)
    path = small_fs(64 * PAGE)
    arena = TieredArena(8, sparse.Adagrad(lr=0.1), dr.StorageOption(tiers=["dram", "ssd"], dram_bytes=20_000,
                                                                    path=str(path)))
    arena.add("t", torch.zeros(1, 8))
    with pytest.raises(ResourceExhausted, match=FULL):
        for i in range(2000):
            arena.rows(torch.zeros(50, dtype=torch.int64), torch.arange(i * 50, (i + 1) * 50), insert=True)
    del arena


# -- deeprec train on a filesystem that fills up ---------------------------------------------------------
_TABLES, _RECORD = 26, 4 * 32 + 24  # dlrm's EmbeddingVariables; dim 16 + adagrad's slot: 152-byte records


def _command(config, data, storage, ckpt, steps=40):
    return [sys.executable, "-m", "deeprec", "train", "--config", str(config), "--data", data, "--batch-size", "128",
            "--seed", "4", "--steps", str(steps), "--embedding", "variable", "--optimizer", "adagrad", "--storage",
            "ssd", "--dram-bytes", str(26 * 162 * 2000), "--storage-path", str(storage), "--checkpoint-dir",
            str(ckpt), "--checkpoint-every", "5", "--resume", "--no-progress"]


def _env():
    # rich wraps at 80 columns when stderr is not a terminal; the error itself is one line
    return {**os.environ, "COLUMNS": "1000"}


@pytest.mark.slow
def test_train_on_a_full_filesystem_exits_1_with_one_line_and_resumes_exactly(tmp_path, unique_tsv, small_fs):
    config = tmp_path / "run.toml"
    config.write_text('[model_overrides]\nbottom_mlp = [32, 16]\ntop_mlp = [32]\n')
    # room for each table's first 1024 disk records (reserved at start) and a little more: the one table
    # with a key per row (C1) outgrows it after a few checkpoints
    per_table = -(-1024 * _RECORD // PAGE)
    fs = small_fs((_TABLES * per_table + 45) * PAGE)
    ckpt = tmp_path / "ckpt"
    done = subprocess.run(_command(config, unique_tsv, fs, ckpt), capture_output=True, text=True, timeout=300,
                          env=_env())
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: no space left on {fs}: "), done.stderr
    assert errors[0] == done.stderr.strip().splitlines()[-1]  # the last line, and one line
    assert os.listdir(fs) == []  # nothing left behind
    saved = sorted(n for n in os.listdir(ckpt) if n.endswith(".pt"))
    assert saved and not any(n.endswith(".tmp") for n in os.listdir(ckpt))
    last = saved[-1]
    assert 0 < int(last[len("checkpoint-"):-3]) < 40
    before = load_checkpoint(str(ckpt / last))  # intact: its manifest's size and sha256 check
    # resume (on a filesystem with room) from that checkpoint: equal to a run that never stopped
    resumed = subprocess.run(_command(config, unique_tsv, tmp_path / "big", ckpt), capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {last}" in resumed.stdout + resumed.stderr
    full = tmp_path / "full"
    subprocess.run(_command(config, unique_tsv, tmp_path / "big", full), check=True, capture_output=True,
                   timeout=300)
    assert_same_model(before["model"], load_checkpoint(str(full / last))["model"])  # what the failed run kept
    name = "checkpoint-000000040.pt"
    assert_same_model(load_checkpoint(str(ckpt / name))["model"], load_checkpoint(str(full / name))["model"])


@pytest.mark.slow
def test_train_with_a_read_only_storage_path_is_one_line_before_training(tmp_path, unique_tsv, small_fs):
    config = tmp_path / "run.toml"
    config.write_text('[model_overrides]\nbottom_mlp = [32, 16]\ntop_mlp = [32]\n')
    ro = _read_only_folder(tmp_path, small_fs)
    done = subprocess.run(_command(config, unique_tsv, ro, tmp_path / "ckpt"), capture_output=True, text=True,
                          timeout=300, env=_env())
    assert done.returncode == 2, done.stderr[-3000:]  # a configuration error (deeprec's CLI convention)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: --storage-path {str(ro)!r} is ") and "step" not in done.stderr, lines
    assert not os.path.exists(tmp_path / "ckpt") or not os.listdir(tmp_path / "ckpt")  # it never trained
