"""Progress is drawn on a terminal, and nothing is printed anywhere else."""
import io
import os
import time

import pytest
import torch
from rich.console import Console

import deeprec as dr
from deeprec import progress as progress_module
from deeprec.data import CriteoReader, write_behavior, write_synthetic
from deeprec.data.presets import CRITEO_SCHEMA
from deeprec.metrics import evaluate
from deeprec.models import build_model
from deeprec.progress import progress


def _terminal() -> Console:
    return Console(force_terminal=True, file=io.StringIO(), width=120)


def _pipe() -> Console:
    return Console(file=io.StringIO(), width=120)


class _Constant(torch.nn.Module):
    def forward(self, batch):
        return {"logits": batch["I1"].nan_to_num(0.0) * 0.01}


@pytest.fixture
def shared():
    """The shared console set to a fake terminal for one test, then reset."""
    console = _terminal()
    progress_module.configure(console)
    yield console
    progress_module.configure()


def test_a_terminal_gets_a_count_and_a_rate():
    console = _terminal()
    with progress("rows read", total=200, console=console) as p:
        assert p.drawn
        p.advance(50)
        time.sleep(0.05)  # a rate needs two samples some time apart
        p.advance(100)
    text = console.file.getvalue()
    assert "rows read" in text and "150/200" in text and "rows/s" in text


def test_anything_else_gets_nothing():
    console = _pipe()
    with progress("rows read", total=200, console=console) as p:
        assert not p.drawn
        p.advance(150)
        p.stage("anything")
    assert console.file.getvalue() == ""


def test_switched_off_the_shared_console_draws_nothing(shared):
    progress_module.configure(shared, enabled=False)
    with progress("evaluate") as p:
        p.advance(5)
    assert not p.drawn and shared.file.getvalue() == ""


def test_evaluate_counts_rows_on_a_terminal_and_scores_the_same(sample, shared):
    quiet = evaluate(_Constant(), CriteoReader(sample, 64), progress=False)
    shown = evaluate(_Constant(), CriteoReader(sample, 64))  # the shared console: a terminal here
    assert shown == quiet and quiet["rows"] == 200
    text = shared.file.getvalue()
    assert "evaluate" in text and "200 rows" in text


def test_evaluate_prints_nothing_when_stderr_is_not_a_terminal(sample, capsys):
    evaluate(_Constant(), CriteoReader(sample, 64))  # pytest's captured stderr is no terminal
    assert capsys.readouterr().err == ""


def test_synth_shows_rows_written_of_the_total_and_writes_the_same_file(tmp_path):
    console = _terminal()
    write_synthetic(str(tmp_path / "a.tsv"), 1000, cardinalities="small", chunk_rows=300, progress=console)
    write_synthetic(str(tmp_path / "b.tsv"), 1000, cardinalities="small", chunk_rows=300, progress=_pipe())
    assert "1000/1000" in console.file.getvalue() and "synth" in console.file.getvalue()
    assert (tmp_path / "a.tsv").read_bytes() == (tmp_path / "b.tsv").read_bytes()
    behavior = _terminal()
    write_behavior(str(tmp_path / "c.tsv"), 500, users=50, items=200, categories=10, chunk_rows=200,
                   progress=behavior)
    assert "500/500" in behavior.file.getvalue()


@pytest.mark.slow
def test_export_names_its_stages_on_a_terminal(tmp_path):
    console = _terminal()
    model = build_model("dlrm", CRITEO_SCHEMA)
    path = dr.export(model, str(tmp_path / "e"), schema=CRITEO_SCHEMA, progress=console, compile=False)
    text = console.file.getvalue()
    for stage in ("freezing variables", "tracing (torch.export)", "writing the program", "writing weights"):
        assert f"export: {stage}" in text
    assert os.path.exists(os.path.join(path, "manifest.json"))


def test_drawn_beneath_a_live_display_of_the_same_console(sample, shared):
    # the trainer's step bar is live while it evaluates or exports: both are drawn, neither raises
    from rich.progress import Progress

    with Progress(console=shared) as outer:
        outer.add_task("train steps", total=10)
        assert evaluate(_Constant(), CriteoReader(sample, 64))["rows"] == 200
        with progress("synth", total=200) as inner:  # kept (not transient): printed when it ends
            inner.advance(200)
    text = shared.file.getvalue()
    assert "train steps" in text and "synth" in text and "200/200" in text
