"""deeprec.data.fs's read-ahead thread: it ends, and closes its source, whenever the consumer stops;
whatever ends it reaches the consumer as one line naming the file, never a bug's traceback or a hang."""
import threading
import time

import pytest

from deeprec.data import fs
from deeprec.data.ranged import StoreError
from deeprec.errors import DataError


def _read_ahead_threads() -> set:
    return {t for t in threading.enumerate() if t.name == "deeprec-read-ahead"}


def _wait_gone(threads: set, seconds: float = 5.0) -> set:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        time.sleep(0.05)
    return {t for t in threads if t.is_alive()}


@pytest.mark.parametrize("fails", [False, True])
def test_a_consumer_stopping_while_the_queue_is_full_ends_the_thread(fails):
    closed, queued = [], threading.Event()

    def source():
        try:
            yield from (b"a", b"b")
            queued.set()  # b"b" is queued (the queue holds 1): the end (or the error) waits for room
            if fails:
                raise OSError("the read after the consumer left")
        finally:
            closed.append(True)

    before = _read_ahead_threads()
    blocks = fs._prefetched(source(), 1, "day.tsv")
    assert next(blocks) == b"a"
    assert queued.wait(5), "the read-ahead thread never queued the second block"
    started = _read_ahead_threads() - before
    assert len(started) == 1
    blocks.close()
    assert not _wait_gone(started), "the read-ahead thread hangs after its consumer stopped"
    assert closed == [True]


def test_an_error_reaches_the_consumer_after_the_items_as_one_line_naming_the_file():
    def source():
        yield 1
        raise OSError("disk gone")

    blocks = fs._prefetched(source(), 2, "s3://bucket/day.tsv")
    assert next(blocks) == 1
    with pytest.raises(StoreError) as caught:
        next(blocks)
    assert str(caught.value) == "s3://bucket/day.tsv: cannot read (OSError: disk gone)"


def test_a_bug_in_the_thread_is_one_line_and_deeprec_errors_pass_as_they_are():
    def buggy():
        yield 1
        raise TypeError("unsupported operand")

    blocks = fs._prefetched(buggy(), 2, "day.tsv")
    next(blocks)
    with pytest.raises(DataError, match=r"^day.tsv: cannot read \(TypeError: unsupported operand\)$"):
        next(blocks)

    def bad_file():
        raise DataError("cannot decompress (bad magic): a truncated or corrupt gzip file", "day.tsv.gz")
        yield

    with pytest.raises(DataError, match=r"^day.tsv.gz: cannot decompress") as caught:
        next(fs._prefetched(bad_file(), 2, "day.tsv.gz"))
    assert type(caught.value) is DataError


def test_a_thread_that_ends_without_a_word_is_said_not_waited_for(monkeypatch):
    class Silent:  # a read-ahead thread that never runs: the consumer must not wait on its queue forever
        def __init__(self, target, name, daemon):
            pass

        def start(self):
            pass

        def is_alive(self):
            return False

    monkeypatch.setattr(fs.threading, "Thread", Silent)
    with pytest.raises(StoreError, match="^day.tsv: cannot read .*the read-ahead thread ended without handing on"):
        next(fs._prefetched(iter([1, 2]), 2, "day.tsv"))


def test_a_local_file_removed_before_its_read_is_one_line(tmp_path):
    path = tmp_path / "day.tsv.gz"
    with pytest.raises(StoreError, match=rf"^{path}: no such file or object$") as caught:
        next(fs.iter_blocks(str(path)))
    assert caught.value.missing
