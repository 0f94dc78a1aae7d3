"""One event, one line: where deeprec's output is not a terminal, no message is wrapped (rich would cut
it at 80 columns), and `deeprec launch` passes each worker's lines through whole, prefixed."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from rich.table import Table

from deeprec.console import make_console


def test_a_message_to_a_file_or_pipe_is_one_line_however_long():
    message = "checkpoint " + "/very/long/path" * 30 + " written"  # 471 characters, spaces between words
    out = io.StringIO()
    console = make_console(file=out)
    console.print(message)
    console.print("[bold]marked up[/bold]", message)
    assert out.getvalue().splitlines() == [message, f"marked up {message}"]


def test_on_a_terminal_rich_still_wraps_to_the_window_and_tables_keep_their_layout():
    message = "word " * 40
    terminal = io.StringIO()
    make_console(file=terminal, force_terminal=True, width=80, color_system=None).print(message)
    assert len(terminal.getvalue().splitlines()) == 3
    table = Table("name", "value")
    table.add_row("x" * 10, "y" * 200)
    piped = io.StringIO()
    make_console(file=piped).print(table)
    assert all(len(line) <= 80 for line in piped.getvalue().splitlines())  # a table is laid out at the width


@pytest.mark.slow
def test_a_300_character_log_line_comes_through_deeprec_launch_whole(tmp_path):
    ckpt = tmp_path / ("c" * 240)  # "no checkpoint in <it>: starting from step 0 (--resume)" is > 300 characters
    done = subprocess.run([sys.executable, "-m", "deeprec.cli", "launch", "--workers", "2", "--collective", "--resume",
                           "--", "train", "--synthetic", "2000", "--cardinalities", "small", "--steps", "2",
                           "--batch-size", "32", "--no-progress", "--threads", "1", "--checkpoint-dir", str(ckpt)],
                          capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1", DEEPREC_CACHE=str(tmp_path / "cache")))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    said = [line for line in lines if f"no checkpoint in {ckpt}" in line]
    assert len(said) == 2, done.stdout[-4000:]  # each rank's, whole
    for rank in (0, 1):
        line = f"[worker{rank}] no checkpoint in {ckpt}: starting from step 0"
        assert len(line) >= 300 and sum(x.startswith(line) for x in said) == 1, said
    assert all(line.startswith(("[worker0] ", "[worker1] ", "[launch] ")) for line in lines), done.stdout[-4000:]
