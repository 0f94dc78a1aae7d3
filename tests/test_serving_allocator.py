"""`deeprec serve --allocator`: mimalloc preloaded by a re-execution of the command, scores unchanged."""
import os
import subprocess
import sys

import httpx
import pytest
import torch

import deeprec as dr
from deeprec.errors import ConfigError
from deeprec.serving.allocator import mimalloc_library, run_with

from test_serving import _dlrm_export


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


@pytest.mark.slow(reason="a server start and its re-execution with mimalloc preloaded")
@pytest.mark.skipif(mimalloc_library() is None or not sys.platform.startswith("linux"),
                    reason="cmeel-mimalloc is not installed")
def test_serve_runs_with_mimalloc_and_answers_the_same_scores(tmp_path):
    path, rows = _dlrm_export(tmp_path, rows=8)
    env = {k: v for k, v in os.environ.items() if k != "DEEPREC_SERVE_ALLOCATOR"}  # the default: auto
    log = open(tmp_path / "serve.log", "w+")  # a file: a pipe nobody reads could fill and block the server
    proc = subprocess.Popen([sys.executable, "-m", "deeprec", "serve", path, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), (line, log.seek(0) or log.read())
        # re-executed in place (the same pid, so a supervisor's signals still reach it), mimalloc mapped
        assert "libmimalloc" in _maps(proc.pid)
        reply = httpx.post(f"{line.split()[-1]}/v1/predict", json={"inputs": rows}, timeout=30)
        assert reply.status_code == 200, reply.text
        want = dr.serving.load(path)(rows)
        assert torch.equal(torch.tensor(reply.json()["scores"], dtype=torch.float32), want)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    assert proc.returncode == -15


def test_allocator_choices():
    with pytest.raises(ConfigError, match="--allocator 'tcmalloc': one of auto, mimalloc, system"):
        run_with("tcmalloc", ["serve", "x"])
    run_with("system", ["serve", "x"])  # nothing to do: returns
