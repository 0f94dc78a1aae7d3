"""Reproductions of the faults found by trying deeprec as a new user and by a fault probe
(issue 14): each failed before its fix."""
import io
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rich.console import Console

import deeprec as dr
from deeprec.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from deeprec.cli import sample_path
from deeprec.data import Column, CsvReader, Schema, open_reader
from deeprec.errors import CheckpointError, ConfigError, DataError, NonFiniteError
from deeprec.trainer import TrainConfig, Trainer
from output import line_with


def _first_batch(reader, timeout: float = 60.0):
    """next(iter(reader)) in a thread: a reader that loops without yielding fails the test, not the suite."""
    result = {}

    def run():
        try:
            result["batch"] = next(iter(reader), None)
        except BaseException as err:  # handed to the test
            result["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the reader loops without yielding a batch"
    if "error" in result:
        raise result["error"]
    return result["batch"]


@pytest.mark.slow
def test_din_on_the_short_sample_fails_at_once_naming_the_batch_size():
    # the bundled 200-row sample < batch 512, and DIN (batch norm) drops short batches: it used to spin forever
    proc = subprocess.run([sys.executable, "-m", "deeprec", "train", "--model", "din", "--data",
                           sample_path("movielens_sample.txt"), "--steps", "10", "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert line_with(proc.stderr, "200 valid rows < batch size 512", "lower --batch-size")


@pytest.mark.parametrize("epochs", [None, 1])
def test_header_only_file_is_an_error_not_a_loop(tmp_path, sample, epochs):
    path = tmp_path / "header.csv"
    path.write_text(open(sample).readline())
    reader = open_reader([str(path)], 64, num_epochs=epochs)
    with pytest.raises(DataError, match="no data rows"):
        _first_batch(reader)


def test_every_row_bad_under_skip_is_an_error(tmp_path, sample):
    lines = open(sample).read().splitlines()
    path = tmp_path / "bad.csv"
    path.write_text("\n".join([lines[0]] + [line.replace(",", ";", 3) for line in lines[1:20]]) + "\n")
    reader = open_reader([str(path)], 8, num_epochs=None, on_bad_row="skip")
    with pytest.raises(DataError, match="all 19 rows are bad"):
        _first_batch(reader)


def test_one_epoch_with_no_batch_does_not_exit_with_zero_steps():
    # it used to exit 0 with 0 steps and loss nan
    cfg = TrainConfig.create(model="din", data=[sample_path("movielens_sample.txt")], epochs=1, progress=False)
    with pytest.raises(DataError, match="200 valid rows < batch size 512"):
        Trainer(cfg).train()


# -- non-finite values ---------------------------------------------------------------------
@pytest.mark.parametrize("value", ["1e39", "1e308", "inf", "-inf"])  # "nan" is read as missing (Arrow)
def test_a_dense_value_beyond_float32_is_a_bad_row(tmp_path, sample, value):
    lines = open(sample).read().splitlines()
    fields = lines[5].split(",")
    fields[3] = value  # I3
    path = tmp_path / "big.csv"
    path.write_text("\n".join(lines[:5] + [",".join(fields)] + lines[6:40]) + "\n")
    with pytest.raises(DataError, match=r"big.csv:6: I3 must be a finite float32"):
        list(open_reader([str(path)], 16))
    reader = open_reader([str(path)], 16, on_bad_row="skip")
    assert sum(len(b["label"]) for b in reader) == 38 and reader.stats.bad_rows == 1


def _poisoned_trainer(tmp_path, sample, on_nan, steps=6, poison_batch=3):
    cfg = TrainConfig.create(model="dlrm", data=[sample], steps=steps, batch_size=32, progress=False, seed=1,
                             on_nan=on_nan, model_overrides={"hash_buckets": 100, "bottom_mlp": (16,), "top_mlp": (8,)})
    trainer = Trainer(cfg)
    to_batch, count = trainer.train_reader._to_batch, [0]

    def poisoned(*rows):  # what a reader bug, a bad feature op or an overflow would hand the model
        batch = to_batch(*rows)
        count[0] += 1
        if count[0] == poison_batch:
            batch["I2"][0] = float("inf")
        return batch

    trainer.train_reader._to_batch = poisoned
    return trainer


def test_a_nonfinite_loss_stops_the_run_with_step_and_position_and_is_not_applied(tmp_path, sample):
    trainer = _poisoned_trainer(tmp_path, sample, "raise")
    with pytest.raises(NonFiniteError, match=r"non-finite loss at step 3 \(reader epoch 0, batch 3"):
        trainer.train()
    clean = Trainer(TrainConfig.create(**{**trainer.cfg.__dict__, "steps": 2}))
    clean.train()
    assert trainer.step == 2
    pairs = zip([*trainer.model.named_parameters(), *trainer.model.named_buffers()],
                [*clean.model.parameters(), *clean.model.buffers()], strict=True)
    for (name, a), b in pairs:
        assert torch.equal(a, b), name  # the poisoned step changed nothing


def test_skip_counts_the_batch_and_trains_on(tmp_path, sample):
    result = _poisoned_trainer(tmp_path, sample, "skip").train()
    assert result["skipped_nonfinite"] == 1 and result["steps"] == 6
    assert np.isfinite(result["final_loss"])


def test_the_ps_refuses_nonfinite_pushes(tmp_path):
    import grpc

    from deeprec.distributed import PSClient
    from deeprec.distributed.ps.shard import SERVICE
    from deeprec.distributed.ps.wire import pack

    proc = subprocess.Popen([sys.executable, "-m", "deeprec.distributed.ps", "--bind", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().split()[-1]
        client = PSClient([address], deadline_s=20)
        client.register({"emb": 2}, {"w": torch.ones(3)}, optimizer="sgd", lr=1.0)
        before = client.pull({"emb": torch.tensor([4, 5])}, ["w"])
        push = grpc.insecure_channel(address).unary_unary(f"/{SERVICE}/Push")
        for grads, dense in [(torch.tensor([[1.0, float("nan")], [0.0, 0.0]]), torch.zeros(3)),
                             (torch.zeros(2, 2), torch.tensor([0.0, float("inf"), 0.0]))]:
            message = pack({"embeddings": ["emb"], "dense": ["w"]},
                           {"keys": torch.tensor([4, 5]), "counts": torch.tensor([2]), "grads/2": grads, "dense/w": dense})
            with pytest.raises(grpc.RpcError) as err:
                push(message, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "non-finite" in err.value.details()
        after = client.pull({"emb": torch.tensor([4, 5])}, ["w"], train=False)
        assert all(torch.equal(before[k], after[k]) for k in before)  # nothing half-applied
        client.close()
    finally:
        proc.kill()
        proc.wait(10)


# -- checkpoints ---------------------------------------------------------------------------
def _tiny_cfg(data, ckpt, **kw):
    base = dict(model="dlrm", data=[data], batch_size=256, shuffle_buffer=1000, seed=4, checkpoint_dir=str(ckpt),
                progress=False, model_overrides={"hash_buckets": 1000, "bottom_mlp": (32, 16), "top_mlp": (32,)})
    return TrainConfig.create(**{**base, **kw})


def _model_tensors(state: dict) -> dict:
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


def test_flipped_bytes_are_refused_naming_the_file(tmp_path):
    path = save_checkpoint(str(tmp_path), 7, {"w": torch.randn(4096), "step": 7})
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2: len(data) // 2 + 1024] = bytes(b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + 1024])
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"checkpoint-000000007.pt: corrupt: the payload's sha256"):
        load_checkpoint(path)


@pytest.mark.parametrize("damage", ["truncate", "empty", "no manifest"])
def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, unique_tsv, damage):
    Trainer(_tiny_cfg(unique_tsv, tmp_path, steps=6, checkpoint_every=3)).train()
    latest = tmp_path / "checkpoint-000000006.pt"
    if damage == "no manifest":  # killed between the payload's rename and the manifest's
        os.unlink(tmp_path / "checkpoint-000000006.manifest.json")
    else:
        latest.write_bytes(latest.read_bytes()[: 0 if damage == "empty" else 1000])
    with pytest.raises(CheckpointError, match="checkpoint-000000006.pt: "):
        load_checkpoint(str(latest))
    console = Console(file=io.StringIO(), width=400)
    resumed = Trainer(_tiny_cfg(unique_tsv, tmp_path, steps=6, resume=True), console=console)
    assert resumed.step == 3
    assert "skipped checkpoint" in console.file.getvalue() and "checkpoint-000000006.pt" in console.file.getvalue()
    resumed.train()
    reference = Trainer(_tiny_cfg(unique_tsv, tmp_path / "ref", steps=6))
    reference.train()
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.state_dict().values(),
                                                 reference.model.state_dict().values()) if isinstance(a, torch.Tensor))


def test_every_checkpoint_corrupt_is_an_error_not_a_fresh_start(tmp_path, unique_tsv):
    Trainer(_tiny_cfg(unique_tsv, tmp_path, steps=2)).train()
    (tmp_path / "checkpoint-000000002.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no intact full checkpoint"):
        Trainer(_tiny_cfg(unique_tsv, tmp_path, steps=4, resume=True))


def test_stale_temporary_files_are_removed_at_start(tmp_path, unique_tsv):
    stale = tmp_path / ".checkpoint-abc123.tmp"
    stale.write_bytes(b"x" * 1000)
    other = tmp_path / "notes.txt"
    other.write_text("kept")
    Trainer(_tiny_cfg(unique_tsv, tmp_path, steps=1))
    assert not stale.exists() and other.exists()


def _latest_step(directory) -> int:
    found = list_checkpoints(str(directory))
    return int(os.path.basename(found[-1])[11:20]) if found else -1


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_reproduces_the_uninterrupted_run(tmp_path, unique_tsv):
    # ~10 kills at random moments of a run that checkpoints every step (kills land in writes too);
    # each resume must succeed, and the run finished by resumes equals the uninterrupted one exactly
    config = tmp_path / "run.toml"
    config.write_text('[model_overrides]\nhash_buckets = 1000\nbottom_mlp = [32, 16]\ntop_mlp = [32]\n')
    steps = 100

    def command(ckpt):
        return [sys.executable, "-m", "deeprec", "train", "--config", str(config), "--data", unique_tsv,
                "--batch-size", "256", "--shuffle-buffer", "1000", "--seed", "4", "--steps", str(steps),
                "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--resume", "--no-progress"]

    rng = np.random.default_rng(0)
    ckpt, kills = tmp_path / "killed", 0
    for _ in range(25):  # bounded: ~10 kills, then one resume to the end
        proc = subprocess.Popen(command(ckpt), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if kills < 10:  # kill at a random moment after this run's first checkpoint
            start, deadline = _latest_step(ckpt), time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline and _latest_step(ckpt) <= start:
                time.sleep(0.01)
            time.sleep(float(rng.uniform(0.0, 0.3)))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        _, err = proc.communicate(timeout=120)
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, err  # a resume failed on what the kill left
    assert kills == 10 and proc.returncode == 0
    full = tmp_path / "full"
    subprocess.run(command(full), check=True, capture_output=True, timeout=120)
    last = f"checkpoint-{steps:09d}.pt"
    assert not [n for n in os.listdir(ckpt) if n.endswith(".tmp")]
    a, b = load_checkpoint(str(ckpt / last)), load_checkpoint(str(full / last))
    assert a["step"] == b["step"] == steps
    for name, value in _model_tensors(b).items():
        assert torch.equal(_model_tensors(a)[name], value), name


# -- readers -------------------------------------------------------------------------------
SMALL = Schema([Column("click", "label"), Column("price", "dense"), Column("uid", "categorical"),
                Column("shop", "categorical")], delimiter=",", header=True)


def _write(path, lines: list[bytes]) -> str:
    path.write_bytes(b"click,price,uid,shop\n" + b"".join(line + b"\n" for line in lines))
    return str(path)


def _read_all(path, policy, schema=SMALL, batch=4):
    reader = open_reader([path], batch, schema=schema, on_bad_row=policy)
    rows = [bytes(u) for b in reader for u in b["uid"].tolist()]
    return rows, reader.stats.bad_rows


def test_non_utf8_bytes_in_a_numeric_column_are_a_bad_row(tmp_path):
    path = _write(tmp_path / "enc.csv", [b"0,1.5,a,x", b"1,\xff\xfe,b,y", b"0,2,c,z"])
    with pytest.raises(DataError, match=r"enc.csv:3: column price: .*xff.*xfe. is not a number"):
        _read_all(path, "raise")
    assert _read_all(path, "skip") == ([b"a", b"c"], 1)


def test_an_unclosed_quote_is_located_and_every_line_it_swallows_counted(tmp_path):
    path = _write(tmp_path / "quote.csv", [b"0,1,a,x", b'1,2,"b,y', b"0,3,c,z", b"1,4,d,w"])
    with pytest.raises(DataError, match=r"quote.csv:3: unbalanced quote: 3 lines"):
        _read_all(path, "raise")
    assert _read_all(path, "skip") == ([b"a"], 3)


def test_a_tsv_field_starting_with_a_quote_is_data(tmp_path):
    schema = Schema([Column("click", "label"), Column("price", "dense"), Column("uid", "categorical"),
                     Column("shop", "categorical")], delimiter="\t", header=False)
    path = tmp_path / "q.tsv"
    path.write_bytes(b'0\t1\ta\t"x\n1\t2\tb\ty\n')
    rows, bad = _read_all(str(path), "raise", schema)
    assert rows == [b"a", b"b"] and bad == 0


def test_a_quoted_delimiter_does_not_shift_the_reported_line(tmp_path):
    lines = [b"0,1,a,x"] * 4 + [b'1,2,"b,with comma",y', b"0,3,c,z", b"0,oops,d,w", b"1,4,e,v"]
    path = _write(tmp_path / "shift.csv", lines)
    with pytest.raises(DataError, match=r"shift.csv:8: column price: 'oops'"):  # line 8 (header is line 1)
        _read_all(path, "raise")


def _parquet(tmp_path, price) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = len(price)
    path = str(tmp_path / "p.parquet")
    pq.write_table(pa.table({"click": [0.0] * n, "price": price, "uid": [f"u{i}" for i in range(n)],
                             "shop": ["s"] * n}), path, row_group_size=4)
    return path


def test_a_non_number_in_a_parquet_text_column_is_one_bad_row(tmp_path):
    path = _parquet(tmp_path, ["1", "2", "x", "4", "5", ""])
    with pytest.raises(DataError, match=r"p.parquet:row group 0:row 2: column price: 'x' is not a number"):
        _read_all(path, "raise")
    rows, bad = _read_all(path, "skip")
    assert rows == [b"u0", b"u1", b"u3", b"u4", b"u5"] and bad == 1


def test_a_corrupt_parquet_page_names_the_file_and_row_group(tmp_path):
    path = _parquet(tmp_path, [float(i) for i in range(12)])
    data = bytearray(open(path, "rb").read())
    at = data.find(b"u4")  # inside row group 1's pages
    data[at - 40: at + 8] = bytes(48)
    open(path, "wb").write(bytes(data))
    with pytest.raises(DataError, match=r"p.parquet:row group 1:row 0: cannot decode the rest of row group 1"):
        _read_all(path, "raise")
    rows, bad = _read_all(path, "skip")
    assert rows == [b"u0", b"u1", b"u2", b"u3", b"u8", b"u9", b"u10", b"u11"] and bad == 4


def test_an_empty_directory_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"directory '.*empty' holds no data files"):
        open_reader([str(tmp_path / "empty")], 8)


FAULTS = {  # kind -> (make the row's bytes from its id, is the row valid?)
    "good": (lambda i: b"%d,%d.5,id%d,s" % (i % 2, i, i), True),
    "quoted": (lambda i: b'%d,%d,id%d,"s, with comma"' % (i % 2, i, i), True),
    "empty_value": (lambda i: b"1,,id%d,s" % i, True),
    "width": (lambda i: b"1,2,id%d" % i, False),
    "number": (lambda i: b"1,abc,id%d,s" % i, False),
    "encoding": (lambda i: b"1,\xc3\x28,id%d,s" % i, False),
    "inf": (lambda i: b"0,1e39,id%d,s" % i, False),
    "label": (lambda i: b"7,1,id%d,s" % i, False),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.lists(st.sampled_from(sorted(FAULTS)), min_size=1, max_size=40),
       chunk=st.sampled_from([64, 256, 1 << 20]), blank_every=st.integers(0, 5))
def test_fuzz_every_valid_row_once_every_bad_row_counted_or_raised(tmp_path, kinds, chunk, blank_every):
    lines = []
    for i, kind in enumerate(kinds):
        lines.append(FAULTS[kind][0](i))
        if blank_every and i % blank_every == 0:
            lines.append(b"")  # empty lines are no rows, good or bad
    path = _write(tmp_path / "fuzz.csv", lines)
    valid = [b"id%d" % i for i, kind in enumerate(kinds) if FAULTS[kind][1]]
    bad = len(kinds) - len(valid)
    if not valid:
        with pytest.raises(DataError):
            _read_all(path, "skip")
        return
    reader = CsvReader(path, SMALL, 3, on_bad_row="skip", chunk_bytes=chunk)
    assert sorted(bytes(u) for b in reader for u in b["uid"].tolist()) == sorted(valid)
    assert reader.stats.bad_rows == bad
    if bad:
        first = next(i for i, kind in enumerate(kinds) if not FAULTS[kind][1])
        line = 2 + first + (sum(1 for j in range(first) if blank_every and j % blank_every == 0) if blank_every else 0)
        with pytest.raises(DataError, match=rf"fuzz.csv:{line}: "):
            list(CsvReader(path, SMALL, 3, chunk_bytes=chunk))


# -- EmbeddingVariable under concurrency ---------------------------------------------------
def _evicting_ev():
    return dr.EmbeddingVariable(8, ev_option=dr.EmbeddingVariableOption(evict_option=dr.GlobalStepEvict(1)))


def test_duplicate_keys_in_one_call_share_one_row():
    ev = _evicting_ev()
    rows = ev.rows_for(torch.tensor([5, 9, 5, 5, 9]))
    assert rows[0] == rows[2] == rows[3] and rows[1] == rows[4] and rows[0] != rows[1] and ev.size == 2


@pytest.mark.slow
def test_lookups_from_4_threads_while_exporting_with_eviction_read_what_is_stored():
    ev = _evicting_ev()
    expected = ev._defaults  # nothing trains: a key's value is always its initial row
    errors, reads, stop = [], [0], threading.Event()

    def lookups(seed):
        g = torch.Generator().manual_seed(seed)
        try:
            while not stop.is_set():
                keys = torch.unique(torch.randint(0, 5000, (256,), generator=g))
                rows, values, _ = ev.lookup(keys, train=True)  # inserts new keys
                want = expected[torch.remainder(keys, expected.shape[0])]
                if not torch.equal(values, want):
                    errors.append(f"{int((values != want).any(1).sum())} wrong rows")
                reads[0] += 1
        except Exception as err:  # reported by the test, not lost in the thread
            errors.append(repr(err))

    threads = [threading.Thread(target=lookups, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 3.0
    exports = 0
    while time.monotonic() < deadline:
        ev.global_step += 1  # every row not updated for a step is evicted by the next export
        ev.export()
        exports += 1
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors[:3]
    assert exports > 10 and reads[0] > 10 and ev.generation > 0


def test_an_update_held_across_a_compaction_lands_on_the_moved_rows():
    ev = _evicting_ev()
    ev.set_optimizer(dr.optim.SGD(lr=1.0))
    ev.rows_for(torch.tensor([1, 2, 3]))
    ev.global_step = 5
    ev.apply_update(ev.optimizer, ev.rows_for(torch.tensor([3])), torch.zeros(1, 8))  # key 3 stays fresh
    rows, values, generation = ev.lookup(torch.tensor([3, 1]))  # a backward that has not run yet
    ev.export()  # evicts keys 1 and 2: key 3 moves from row 2 to row 0
    assert ev.generation == generation + 1 and ev.size == 1
    ev.apply_update(ev.optimizer, rows, torch.ones(2, 8), generation)
    after = ev.lookup(torch.tensor([3]), train=False)[1]
    assert torch.allclose(after, values[:1] - 1.0)  # key 3 got its update; evicted key 1 none
    assert ev.rows_for(torch.tensor([1]), train=False).item() == -1


# -- evaluation in bounded memory ----------------------------------------------------------
def test_streaming_auc_is_within_its_stated_bound_and_logloss_exact():
    from sklearn.metrics import log_loss, roc_auc_score

    from deeprec.metrics import StreamingMetrics

    rng = np.random.default_rng(3)
    metrics, ys, zs = StreamingMetrics(), [], []
    for _ in range(20):  # batches, as evaluation sees them
        z = rng.normal(-3.0, 1.5, 10_000)  # CTR-like predictions, p around 0.05
        y = (rng.random(10_000) < 1 / (1 + np.exp(-z))).astype(np.float32)
        metrics.update(y, z)
        ys.append(y)
        zs.append(z)
    y, p = np.concatenate(ys), 1 / (1 + np.exp(-np.concatenate(zs)))
    got = metrics.result()
    assert 0 < got["auc_error_bound"] < 1e-4
    assert abs(got["auc"] - roc_auc_score(y, p)) <= got["auc_error_bound"]
    assert got["logloss"] == pytest.approx(log_loss(y, p), rel=1e-10)
    assert metrics.pos.nbytes + metrics.neg.nbytes == 2 * 8 * (1 << 20)  # whatever the rows


def test_eval_every_reports_during_training(tmp_path, unique_tsv):
    trainer = Trainer(_tiny_cfg(unique_tsv, tmp_path, steps=10, eval_every=5, eval_fraction=0.2, checkpoint_dir=None))
    result = trainer.train()
    assert [h["step"] for h in result["eval_history"]] == [5, 10]
    assert result["eval_history"][-1]["rows"] == result["eval"]["rows"] == 2000
    assert result["eval_history"][-1]["auc"] == result["eval"]["auc"]  # the same model, the same rows
