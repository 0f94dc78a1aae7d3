"""tests/prefork.py: a process forked from the suite's fork server starts as an exec'd one does."""
import json
import os
import signal
import subprocess
import sys

import pytest

import prefork

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def probe(monkeypatch, tmp_path):
    """Runs tests/prefork_probe.py both ways: (forked, exec'd) Popen factories with one environment."""
    monkeypatch.setattr(prefork, "MODULES", (*prefork.MODULES, "prefork_probe"))
    env = {**os.environ, "PYTHONPATH": HERE, "PROBE": "x", "OMP_NUM_THREADS": "1"}

    def start(forked: bool, *args, **kw):
        cls = prefork.Popen if forked else prefork._Base
        return cls([sys.executable, "-m", "prefork_probe", *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, stdin=subprocess.PIPE, text=True, **kw)
    return start


def _seen(proc, stdin: str = ""):
    out, err = proc.communicate(stdin, timeout=120)
    return json.loads(out.splitlines()[0]), err, proc.returncode


def test_a_forked_process_starts_as_an_execd_one(probe):
    forked, execd = probe(True), probe(False)
    assert isinstance(forked._pidfd, int) and not isinstance(execd, prefork.Popen)  # forked; exec'd
    (f, f_err, f_code), (e, e_err, e_code) = _seen(forked), _seen(execd)
    draws = ("torch_first", "random")
    assert {k: v for k, v in f.items() if k not in draws} == {k: v for k, v in e.items() if k not in draws}
    assert f_err == e_err == "to stderr\n" and f_code == e_code == 0
    again = _seen(probe(True))[0]  # a fresh process seeds from the OS: two forked ones draw differently
    assert all(again[k] != f[k] for k in draws)


@pytest.mark.parametrize("how, code", [("3", 3), ("raise", 1), ("interrupt", -signal.SIGINT)])
def test_exit_codes_and_tracebacks_are_an_execd_processs(probe, how, code):
    (_, f_err, f_code), (_, e_err, e_code) = _seen(probe(True, how)), _seen(probe(False, how))
    assert f_code == e_code == code
    assert f_err.splitlines()[-1] == e_err.splitlines()[-1]  # the exception's line, as Python prints it


def test_wait_timeout_signals_and_poll(probe):
    proc = probe(True, "wait")
    assert proc.stdout.readline()  # started: its first line
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == -signal.SIGTERM and proc.poll() == -signal.SIGTERM


def test_only_deeprec_commands_are_forked(probe):
    assert prefork._eligible([sys.executable, "-m", "deeprec", "train"], None, None, True, (), None, False,
                             None, None, None, -1)
    assert not prefork._eligible([sys.executable, "-c", "pass"], None, None, True, (), None, False, None, None, None, -1)
    assert not prefork._eligible([sys.executable, "-m", "deeprec"], None, None, True, (3,), None, False,
                                 None, None, None, -1)  # pass_fds: exec'd
    assert not prefork._eligible([sys.executable, "-m", "deeprec"], None, None, True, (), {"PYTHONHASHSEED": "0"},
                                 False, None, None, None, -1)
    script = os.path.join(os.path.dirname(sys.executable), "deeprec")
    assert prefork._eligible([script, "--help"], None, None, True, (), None, False, None, None, None, -1)


def test_without_a_server_commands_are_execd(probe, monkeypatch):
    def no_server():
        raise OSError("pidfd_open: not supported")

    monkeypatch.setattr(prefork, "_server", None)
    monkeypatch.setattr(prefork, "_Server", no_server)
    with pytest.warns(UserWarning, match="no fork server"):
        proc = probe(True)
    assert proc._pidfd is None  # exec'd by Popen itself
    assert _seen(proc)[2] == 0


def test_a_preloaded_module_runs_as_main_as_in_a_fresh_process():
    """deeprec.cli is preloaded in the server: run as __main__ it must not warn or differ."""
    argv = [sys.executable, "-m", "deeprec.cli", "data", "--help"]
    forked = prefork.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    execd = prefork._Base(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert isinstance(forked._pidfd, int)
    assert forked.communicate(timeout=120) == execd.communicate(timeout=120)
    assert forked.returncode == execd.returncode == 0


def test_a_setup_failure_is_raised_as_popen_raises_it(tmp_path):
    with pytest.raises(FileNotFoundError):
        prefork.Popen([sys.executable, "-m", "deeprec", "--help"], cwd=tmp_path / "missing")
