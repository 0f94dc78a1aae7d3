"""deeprec.data.fs's read-ahead thread: it ends, and closes its source, whenever the consumer stops."""
import threading
import time

import pytest

from deeprec.data import fs


def _read_ahead_threads() -> set:
    return {t for t in threading.enumerate() if t.name == "deeprec-read-ahead"}


def _wait_gone(threads: set, seconds: float = 5.0) -> set:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        time.sleep(0.05)
    return {t for t in threads if t.is_alive()}


@pytest.mark.parametrize("fails", [False, True])
def test_a_consumer_stopping_while_the_queue_is_full_ends_the_thread(fails):
    closed = []

    def source():
        try:
            yield from (b"a", b"b")
            if fails:
                raise OSError("the read after the consumer left")
        finally:
            closed.append(True)

    before = _read_ahead_threads()
    blocks = fs._prefetched(source(), 1)
    assert next(blocks) == b"a"
    time.sleep(0.5)  # the thread has queued b"b" and waits to queue the end (or the error)
    started = _read_ahead_threads() - before
    assert len(started) == 1
    blocks.close()
    assert not _wait_gone(started), "the read-ahead thread hangs after its consumer stopped"
    assert closed == [True]


def test_an_error_reaches_the_consumer_after_the_items():
    def source():
        yield 1
        raise OSError("disk gone")

    blocks = fs._prefetched(source(), 2)
    assert next(blocks) == 1
    with pytest.raises(OSError, match="disk gone"):
        next(blocks)
