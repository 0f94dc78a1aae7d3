"""The compiled-package cache's lock (two exports of one program compile it once) and the
DEEPREC_EXPORT_COMPILE default."""
import os
import threading

import pytest

from deeprec.cli import main
from deeprec.errors import ConfigError
from deeprec.serving import compile_cache

from waits import wait_until


def _waiting_on(path) -> int:
    """Lock requests waiting in the kernel on the file `path` (/proc/locks lists a waiter as
    '<n>: -> FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> 0 EOF'; other tests' locks are not counted)."""
    inode = os.stat(path).st_ino
    with open("/proc/locks") as f:
        return sum(1 for line in f if "->" in line and "FLOCK" in line and line.split()[6].endswith(f":{inode}"))


def test_a_second_claim_of_a_key_waits_for_the_first_and_another_key_does_not(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPREC_CACHE", str(tmp_path))
    events = []
    first_in, release = threading.Event(), threading.Event()

    def first():
        with compile_cache.claimed("k1"):
            events.append("first in")
            first_in.set()
            release.wait(60)
            events.append("first out")

    def second():
        with compile_cache.claimed("k1"):
            events.append("second in")

    holder = threading.Thread(target=first)
    holder.start()
    assert first_in.wait(60)
    lock_file = tmp_path / "compiled" / "k1.lock"
    assert _waiting_on(lock_file) == 0
    with compile_cache.claimed("k2"):  # another program: not held up
        events.append("other key in")
    waiter = threading.Thread(target=second)
    waiter.start()
    wait_until(lambda: _waiting_on(lock_file) == 1, 60, "the second claim waiting on the lock")
    assert "second in" not in events
    release.set()
    holder.join(60)
    waiter.join(60)
    assert events == ["first in", "other key in", "first out", "second in"]
    assert _waiting_on(lock_file) == 0


def test_a_cache_folder_that_cannot_be_written_claims_without_a_lock(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("DEEPREC_CACHE", str(tmp_path / "file"))  # a file: no folder can be made under it
    with compile_cache.claimed("k"):
        pass


@pytest.mark.parametrize("value,want", [("0", False), ("off", False), ("False", False), ("1", True), (" yes ", True)])
def test_the_compile_default_follows_the_variable(monkeypatch, value, want):
    monkeypatch.setenv("DEEPREC_EXPORT_COMPILE", value)
    assert compile_cache.compile_by_default() is want
    monkeypatch.delenv("DEEPREC_EXPORT_COMPILE")
    assert compile_cache.compile_by_default() is True


@pytest.mark.slow
def test_a_bad_compile_variable_is_one_line_naming_it(tmp_path, sample, monkeypatch, capsys):
    monkeypatch.setenv("DEEPREC_EXPORT_COMPILE", "maybe")
    with pytest.raises(ConfigError, match="DEEPREC_EXPORT_COMPILE='maybe': expected one of 1, 0"):
        compile_cache.compile_by_default()
    ck = tmp_path / "ck"
    assert main(["train", "--model", "wdl", "--data", sample, "--steps", "2", "--batch-size", "16", "--no-progress",
                 "--checkpoint-dir", str(ck)]) == 0
    assert main(["export", "--checkpoint", str(ck), "--out", str(tmp_path / "e")]) == 2
    assert "DEEPREC_EXPORT_COMPILE='maybe'" in capsys.readouterr().err
    monkeypatch.setenv("DEEPREC_EXPORT_COMPILE", "0")  # no --compile given: the traced program only
    assert main(["export", "--checkpoint", str(ck), "--out", str(tmp_path / "e")]) == 0
    assert not [name for name in os.listdir(tmp_path / "e") if name.endswith(".pt2") and name != "program.pt2"]


def _one_op_program():
    import torch

    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 2

    return torch.export.export(Scale(), (torch.ones(3),))


def test_the_key_follows_what_inductor_generates_not_where_it_caches(monkeypatch):
    program = _one_op_program()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    before = compile_cache.program_key(program, "cpu", {}, [])
    # inductor sets TORCHINDUCTOR_CACHE_DIR at its first compile: the same program keeps its key after it
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/elsewhere")
    assert compile_cache.program_key(program, "cpu", {}, []) == before
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")  # this one changes the code
    assert compile_cache.program_key(program, "cpu", {}, []) != before


@pytest.mark.slow(reason="an AOTInductor compile of a one-op program (about 10 s)")
def test_a_program_compiled_twice_in_one_process_is_compiled_once(tmp_path, monkeypatch):
    import contextlib

    from deeprec.serving.compiled import compile_package

    monkeypatch.setenv("DEEPREC_CACHE", str(tmp_path / "cache"))
    program = _one_op_program()
    with contextlib.ExitStack() as held:
        key = compile_package(program, str(tmp_path / "a.pt2"), "cpu", held)
        assert key is not None  # compiled here
        compile_cache.store(key, str(tmp_path / "a.pt2"))
    with contextlib.ExitStack() as held:  # inductor changed its options and environment at the first compile
        assert compile_package(program, str(tmp_path / "b.pt2"), "cpu", held) is None  # copied from the cache
    assert os.path.getsize(tmp_path / "b.pt2") == os.path.getsize(tmp_path / "a.pt2")
