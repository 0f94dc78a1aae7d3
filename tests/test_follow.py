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
    proc = subprocess.Popen(train, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(tmp_path / "ck") and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(8)  # 3 steps done, then waiting for files
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
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
