"""--follow: files landing while training are each read once, in name order; a stop request ends
the wait; the position resumes exactly."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from deeprec.data import Column, Schema, open_reader
from deeprec.data.follow import FollowReader
from deeprec.errors import ConfigError
from deeprec.trainer import TrainConfig, Trainer
from waits import wait_until

SCHEMA = Schema((Column("label", "label"), Column("row", "categorical", dtype="int"), Column("x", "dense")),
                delimiter=",", header=True)


def write_hour(folder, name: str, first: int, rows: int) -> None:
    """Written under a temporary name, then renamed, as a shipper lands a file."""
    tmp = os.path.join(folder, "_" + name)
    with open(tmp, "w") as f:
        f.write("label,row,x\n")
        for k in range(first, first + rows):
            f.write(f"{k % 2},{k},{k * 0.5}\n")
    os.replace(tmp, os.path.join(folder, name))


def follow(folder, poll=0.05, batch=7, **kw) -> FollowReader:
    return FollowReader([str(folder)], lambda files: open_reader(files, batch, schema=SCHEMA, **kw), poll)


def test_files_landing_while_reading_are_each_read_once_in_name_order(tmp_path):
    write_hour(tmp_path, "hour=01.csv", 0, 20)
    reader = follow(tmp_path)
    seen, stop = [], threading.Event()
    reader.should_stop = stop.is_set

    def land():
        for hour in range(2, 6):
            time.sleep(0.15)
            write_hour(tmp_path, f"hour={hour:02d}.csv", (hour - 1) * 20, 20)
            (tmp_path / "_SUCCESS").write_text("")  # markers are never read
        while len(seen) < 100:
            time.sleep(0.02)
        stop.set()

    writer = threading.Thread(target=land)
    writer.start()
    for batch in reader:
        seen.extend(batch["row"].tolist())
    writer.join()
    assert seen == list(range(100))  # each row once, hours in name order
    assert reader.done == [str(tmp_path / f"hour={h:02d}.csv") for h in range(1, 6)]
    assert reader.stats.rows == 100


def test_a_listing_error_is_logged_once_while_waiting(tmp_path, caplog):
    write_hour(tmp_path, "hour=01.csv", 0, 20)
    (tmp_path / "hour=02.parquet").write_bytes(b"PAR1")  # mixed formats: resolve_paths refuses the folder
    reader = follow(tmp_path)
    with caplog.at_level("WARNING", logger="deeprec.data"):
        assert reader._complete_new_files() == [] and reader._complete_new_files() == []
    said = [r.getMessage() for r in caplog.records if "--follow" in r.getMessage()]
    assert len(said) == 1 and "mixes" in said[0] and "hour=02.parquet" in said[0]


def test_a_file_still_growing_is_waited_for(tmp_path):
    write_hour(tmp_path, "a.csv", 0, 5)
    os.utime(tmp_path / "a.csv", (time.time() - 60, time.time() - 60))  # landed a while ago: taken at once
    reader = follow(tmp_path, poll=0.3)
    growing = tmp_path / "b.csv"
    growing.write_text("label,row,x\n1,5,0.5\n")  # fresh: not yet still for a whole poll
    it = iter(reader)
    first = next(it)
    assert first["row"].tolist() == [0, 1, 2, 3, 4]
    with open(growing, "a") as f:  # still appending when the next look happens
        f.write("0,6,1.0\n")
    reader.should_stop = lambda: False
    assert next(it)["row"].tolist() == [5, 6]  # taken whole once it held still


def test_the_position_resumes_exactly_across_files(tmp_path):
    for hour in range(3):
        write_hour(tmp_path, f"h{hour}.csv", hour * 10, 10)
        os.utime(tmp_path / f"h{hour}.csv", (time.time() - 60, time.time() - 60))  # all there: no wait
    reader = follow(tmp_path, batch=4)
    reader.should_stop = lambda: True  # no wait: stop once nothing is new
    batches = [b["row"].tolist() for b in reader]
    assert sum(batches, []) == list(range(30))
    again = follow(tmp_path, batch=4)
    again.should_stop = lambda: True
    it = iter(again)
    head = [next(it)["row"].tolist() for _ in range(4)]
    resumed = follow(tmp_path, batch=4)
    resumed.load_state_dict(again.state_dict())
    resumed.should_stop = lambda: True
    assert head + [b["row"].tolist() for b in resumed] == batches
    other = FollowReader(["elsewhere"], lambda files: None)
    with pytest.raises(ConfigError, match="resume --follow with the same --data"):
        other.load_state_dict(again.state_dict())


def test_the_trainer_follows_files_landing_until_its_steps(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_hour(data, "h0.csv", 0, 64)
    schema = tmp_path / "schema.toml"
    schema.write_text('delimiter = ","\nheader = true\n[[column]]\nname = "label"\nkind = "label"\n'
                      '[[column]]\nname = "row"\nkind = "categorical"\ndtype = "int"\n'
                      '[[column]]\nname = "x"\nkind = "dense"\n')

    def land():
        for hour in range(1, 4):
            time.sleep(0.5)
            write_hour(data, f"h{hour}.csv", hour * 64, 64)

    writer = threading.Thread(target=land)
    writer.start()
    cfg = TrainConfig.create(model="wdl", data=[str(data)], schema=str(schema), follow=True, follow_interval=0.1,
                             batch_size=16, steps=16, progress=False)
    trainer = Trainer(cfg)
    result = trainer.train()
    writer.join()
    assert result["rows"] == 256 and trainer.train_reader.stats.rows == 256
    followed = trainer.train_reader.done + trainer.train_reader.current  # the last set's end is not asked for
    assert [os.path.basename(f) for f in followed] == ["h0.csv", "h1.csv", "h2.csv", "h3.csv"]
    with pytest.raises(ConfigError, match="--follow reads each file once"):
        TrainConfig.create(data=[str(data)], follow=True, epochs=2)


@pytest.mark.slow
def test_sigterm_ends_the_wait_with_a_checkpoint_and_resume_goes_on(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    from deeprec.data import write_synthetic

    write_synthetic(str(data / "h0.tsv"), 300, cardinalities="small", seed=0)
    train = [sys.executable, "-m", "deeprec.cli", "train", "--data", str(data), "--follow", "--follow-interval", "0.2",
             "--batch-size", "100", "--checkpoint-dir", str(tmp_path / "ck"), "--no-progress"]
    log = tmp_path / "train.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(train + ["--log-every", "1"], stdout=sink, stderr=subprocess.STDOUT, text=True)
    # 3 steps done (the file's 300 rows), then it waits for files
    wait_until(lambda: "step 3 loss" in log.read_text() or proc.poll() is not None, 120, "step 3")
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    out = log.read_text()
    assert proc.returncode == 143, out[-3000:]
    assert "stopped by SIGTERM after step 3" in out
    write_synthetic(str(data / "h1.tsv"), 200, cardinalities="small", seed=1)
    done = subprocess.run(train[:-1] + ["--resume", "--steps", "5", "--json", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "resumed from checkpoint-000000003.pt at step 3" in done.stdout + done.stderr
    state = torch.load(sorted((tmp_path / "ck").glob("checkpoint-*.pt"))[-1], weights_only=False)
    followed = state["reader"]["done"] + state["reader"]["current"]
    assert [os.path.basename(f) for f in followed] == ["h0.tsv", "h1.tsv"]
    assert json.load(open(tmp_path / "r.json"))["rows"] == 200  # only the new file's rows


def test_workers_of_a_job_split_the_files_whole(tmp_path):
    for hour in range(8):
        write_hour(tmp_path, f"h{hour}.csv", hour * 3, 3)
        os.utime(tmp_path / f"h{hour}.csv", (time.time() - 60, time.time() - 60))
    cfg = TrainConfig.create(data=[str(tmp_path)], schema=None, follow=True, follow_interval=0.05, batch_size=2)
    from deeprec.trainer import make_readers

    rows = []
    for worker in range(3):
        reader, _ = make_readers(cfg, SCHEMA, train_shards={"shard_index": worker, "num_shards": 3})
        reader.should_stop = lambda: True
        mine = [r for b in reader for r in b["row"].tolist()]
        files = {r // 3 for r in mine}
        assert all(sum(1 for r in mine if r // 3 == f) == 3 for f in files)  # whole files only
        rows += mine
    assert sorted(rows) == list(range(24))  # every row once across the workers


# -- a file's faults never end the stream (issue 42) ----------------------------------------
def write_old(folder, name: str, first: int, rows: int, bad_line: int | None = None, header: str = "label,row,x"):
    """A file landed a while ago (taken at the first look); line `bad_line` (1 = the header) not a number."""
    lines = [header] + [f"{k % 2},{k},{k * 0.5}" for k in range(first, first + rows)]
    if bad_line is not None:
        lines[bad_line - 1] = f"x,{first + bad_line - 2},0.5"
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.utime(path, (time.time() - 60, time.time() - 60))
    return path


def rows_of(reader) -> list[int]:
    return [r for b in reader for r in b["row"].tolist()]


def test_a_bad_row_under_raise_quarantines_its_file_and_the_stream_goes_on(tmp_path, caplog):
    h0, h1, h2 = (write_old(tmp_path, "h0.csv", 0, 20), write_old(tmp_path, "h1.csv", 20, 100, bad_line=51),
                  write_old(tmp_path, "h2.csv", 120, 20))
    reader = follow(tmp_path, batch=10, chunk_bytes=300)  # chunks of ~30 lines: those before line 51's are read
    reader.should_stop = lambda: True  # no wait: stop once nothing is new
    with caplog.at_level("WARNING", logger="deeprec.data"):
        rows = rows_of(reader)
    kept = [r for r in rows if 20 <= r < 120]
    assert kept == list(range(20, 20 + len(kept))) and 0 < len(kept) < 49  # whole chunks before the bad row
    assert rows == list(range(20)) + kept + list(range(120, 140))  # h2 after it, each row once
    assert list(reader.quarantined) == [h1] and f"{h1}:51: " in reader.quarantined[h1]
    assert reader.done == [h0, h2]
    said = [r.getMessage() for r in caplog.records if "quarantined" in r.getMessage()]
    assert len(said) == 1 and f"quarantined {h1} after {h1}:51: column label" in said[0], said
    resumed = follow(tmp_path, batch=10, chunk_bytes=300)
    resumed.load_state_dict(reader.state_dict())
    resumed.should_stop = lambda: True
    assert rows_of(resumed) == [] and list(resumed.quarantined) == [h1]  # never read again


def test_a_quarantine_mid_set_resumes_exactly(tmp_path):
    write_old(tmp_path, "h0.csv", 0, 20)
    write_old(tmp_path, "h1.csv", 20, 100, bad_line=51)
    write_old(tmp_path, "h2.csv", 120, 40)
    whole = follow(tmp_path, batch=10, chunk_bytes=300)
    whole.should_stop = lambda: True
    expected = rows_of(whole)
    first = follow(tmp_path, batch=10, chunk_bytes=300)
    first.should_stop = lambda: True
    it, head = iter(first), []
    while not head or head[-1] < 125:  # past the quarantine, into h2
        head += next(it)["row"].tolist()
    resumed = follow(tmp_path, batch=10, chunk_bytes=300)
    resumed.load_state_dict(first.state_dict())
    resumed.should_stop = lambda: True
    assert head + rows_of(resumed) == expected


def test_a_bad_row_under_skip_is_skipped_and_counted(tmp_path):
    write_old(tmp_path, "h0.csv", 0, 100, bad_line=51)
    write_old(tmp_path, "h1.csv", 100, 20)
    reader = follow(tmp_path, batch=10, on_bad_row="skip")
    reader.should_stop = lambda: True
    assert rows_of(reader) == [r for r in range(120) if r != 49]
    assert reader.stats.bad_rows == 1 and reader.quarantined == {} and len(reader.done) == 2


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_file_that_cannot_be_read_is_quarantined_and_the_others_are_read(tmp_path, caplog, policy):
    write_old(tmp_path, "h0.csv", 0, 20)
    lacking = write_old(tmp_path, "h1.csv", 20, 20, header="label,row,y")  # its header lacks x
    write_old(tmp_path, "h2.csv", 40, 20)
    reader = follow(tmp_path, batch=8, on_bad_row=policy)
    reader.should_stop = lambda: True
    with caplog.at_level("WARNING", logger="deeprec.data"):
        assert rows_of(reader) == list(range(20)) + list(range(40, 60))
    assert list(reader.quarantined) == [lacking] and "header lacks column(s) x" in reader.quarantined[lacking]
    assert any(f"quarantined {lacking} after {lacking}:1: header lacks" in r.getMessage() for r in caplog.records)


def test_rows_appended_or_a_file_renamed_over_a_name_read_are_reported_once(tmp_path, caplog):
    h0, h1 = write_old(tmp_path, "h0.csv", 0, 10), write_old(tmp_path, "h1.csv", 10, 10)
    reader = follow(tmp_path, batch=4)
    reader.should_stop = lambda: True
    assert rows_of(reader) == list(range(20))
    size = os.path.getsize(h0)
    with open(h0, "a") as f:  # a writer appending to a file already taken
        f.write("1,20,10.0\n")
    write_hour(tmp_path, "h1.csv", 100, 5)  # a new file renamed over a name already read
    with caplog.at_level("WARNING", logger="deeprec.data"):
        assert rows_of(reader) == []  # neither is read: a file is read once, at the version taken
        assert rows_of(reader) == []  # and each change is said once
    said = [r.getMessage() for r in caplog.records if "after it was taken" in r.getMessage()]
    assert len(said) == 2, said
    assert said[0].startswith(f"--follow: {h0} grew from {size} to {size + 10} bytes after it was taken; it is not read again")
    assert said[1].startswith(f"--follow: {h1} was replaced by another file or object")
    assert "land new rows as a new file" in said[0]
    write_hour(tmp_path, "h2.csv", 20, 3)  # new names are still read
    os.utime(tmp_path / "h2.csv", (time.time() - 60, time.time() - 60))
    assert rows_of(reader) == [20, 21, 22]


def test_the_trainer_trains_on_past_a_quarantined_file(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_old(data, "h0.csv", 0, 64)
    write_old(data, "h1.csv", 64, 64, bad_line=30)
    write_old(data, "h2.csv", 128, 64)
    schema = tmp_path / "schema.toml"
    schema.write_text('delimiter = ","\nheader = true\n[[column]]\nname = "label"\nkind = "label"\n'
                      '[[column]]\nname = "row"\nkind = "categorical"\ndtype = "int"\n'
                      '[[column]]\nname = "x"\nkind = "dense"\n')
    cfg = TrainConfig.create(model="wdl", data=[str(data)], schema=str(schema), follow=True, follow_interval=0.05,
                             batch_size=16, steps=8, progress=False, on_bad_row="raise")
    trainer = Trainer(cfg)
    assert trainer.train()["rows"] == 128  # h0 and h2: h1's one chunk held its bad row
    assert list(trainer.train_reader.quarantined) == [str(data / "h1.csv")]
