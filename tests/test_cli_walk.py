"""Every option of every subcommand, and every key of a --config file, given a wrong value: the
command exits 2 or 1 within 30 s, with one error line naming the option and no traceback.

The walk reads argparse's actions, so a new flag is walked without touching this file. Wrong
values are what is wrong for any option of that kind: a non-number for a number, a value outside
a declared bound, a word that is no choice, and for a file that is read: a missing file, a
folder, a device that never ends (/dev/zero)."""
import argparse
import dataclasses
import io
import signal
import typing
from contextlib import redirect_stderr, redirect_stdout

import pytest

from deeprec.cli import build_parser, main, sample_path

READ_FILES = {"--data", "--eval-data", "--config", "--schema", "--checkpoint", "input", "model_dir", "--token-file"}
FOLDER_OK = {"--data", "--eval-data", "--checkpoint", "model_dir"}  # a folder of data files, of checkpoints
SKIP = {"-h", "--help", "--version"}
NUMBER_TYPES = {"port_number", "positive_float", "non_negative_float", "bytes_flag"}


def _subcommands():
    parser = build_parser()
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in top.choices.items():
        if name == "data":
            inner = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction))
            for child, sub2 in inner.choices.items():
                yield ("data", child), sub2
        else:
            yield (name,), sub


def _bounds(action) -> dict:
    """The declared bounds of the field behind a flag (deeprec.options), if any."""
    from deeprec.train_config import TrainConfig

    node, cls = action.dest.split("."), TrainConfig
    for part in node:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            return {}
        field = fields[part]
        nested = typing.get_type_hints(cls)[part]
        if dataclasses.is_dataclass(nested):
            cls = nested
        else:
            return {k: field.metadata[k] for k in ("ge", "gt") if k in field.metadata}
    return {}


def _wrong_values(action, tmp_path) -> list[str]:
    names = set(action.option_strings) or {action.dest}
    if action.choices is not None and not isinstance(action.choices, dict):
        return ["not-a-choice"]
    kind = getattr(action.type, "__name__", "")
    values = []
    if action.type in (int, float) or kind.startswith("int >=") or kind in NUMBER_TYPES or _bounds(action):
        values += ["abc", "-1"]  # no count, size, port, seed or interval here is negative
    if names & READ_FILES:
        values += [str(tmp_path / "missing" / "file"), "/dev/zero"]
        if not names & FOLDER_OK:
            values.append(str(tmp_path))
    return values


def _base_args(command: tuple, checkpoint: str, export_dir: str, tmp_path) -> dict:
    sample = sample_path()
    return {
        ("train",): ["--steps", "1", "--no-progress"],
        ("launch",): [],
        ("explain",): [],
        ("evaluate",): ["--checkpoint", checkpoint, "--data", sample],
        ("export",): ["--checkpoint", checkpoint, "--out", str(tmp_path / "export"), "--no-compile"],  # 30 s alarm
        ("serve",): [export_dir],
        ("data", "synth"): ["--rows", "10", "--out", str(tmp_path / "synth.tsv")],
        ("data", "convert"): [sample, "--out", str(tmp_path / "converted.parquet")],
    }[command]


def _replace(base: list[str], action, value: str) -> list[str]:
    """`base` with the option (or positional) set to `value`."""
    out, skip = [], 0
    for i, arg in enumerate(base):
        if skip:
            skip -= 1
            continue
        if arg in action.option_strings:
            skip = 1
            continue
        out.append(arg)
    if not action.option_strings:  # a positional: it replaces the base's one at its place
        positional = [a for a in base if not a.startswith("-")]
        index = out.index(positional[0]) if positional else 0
        return out[:index] + [value] + out[index + 1:]
    return out + [action.option_strings[0], value]


def _cases(tmp_path):
    for command, sub in _subcommands():
        for action in sub._actions:
            if set(action.option_strings) & SKIP or action.dest in ("rest", "help"):
                continue
            if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                   argparse.BooleanOptionalAction)):
                continue
            for value in _wrong_values(action, tmp_path):
                yield command, action, value


class _Timeout(Exception):
    pass


def _run(argv: list[str]) -> tuple[int, str]:
    def alarm(*_):
        raise _Timeout(" ".join(argv))

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(30)
    err, out = io.StringIO(), io.StringIO()
    try:
        with redirect_stderr(err), redirect_stdout(out):
            try:
                code = main(argv)
            except SystemExit as stop:
                code = stop.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return code, err.getvalue()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("walk")
    checkpoint, export_dir = str(folder / "ck"), str(folder / "exported")
    assert _run(["train", "--steps", "2", "--no-progress", "--checkpoint-dir", checkpoint])[0] == 0
    assert _run(["export", "--checkpoint", checkpoint, "--out", export_dir, "--no-compile"])[0] == 0  # within 30 s
    return checkpoint, export_dir


@pytest.mark.slow
def test_every_option_of_every_subcommand_refuses_a_wrong_value(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    checkpoint, export_dir = trained
    failures, walked = [], 0
    for command, action, value in _cases(tmp_path):
        argv = [*command, *_replace(_base_args(command, checkpoint, export_dir, tmp_path), action, value)]
        if command == ("launch",):
            argv += ["--", "train", "--steps", "1"]
        walked += 1
        try:
            code, err = _run(argv)
        except _Timeout:
            failures.append((argv, "no answer within 30 s"))
            continue
        names = set(action.option_strings) or {action.dest, value}
        lines = [line for line in err.strip().splitlines() if line.strip()]
        if code not in (1, 2) or "Traceback" in err or not any(n in err for n in names) or \
                len([line for line in lines if "error" in line]) != 1:
            failures.append((argv, code, err[-600:]))
    assert walked > 60, walked  # the walk really reached the options
    assert not failures, "\n".join(map(str, failures))


@pytest.mark.slow
def test_every_config_file_key_refuses_a_wrong_value(tmp_path):
    """Each key of each section, given a value of the wrong type, names itself."""
    from deeprec.options import flat_names
    from deeprec.train_config import TrainConfig

    failures = []
    for flat, path in sorted(flat_names(TrainConfig).items()):
        if path == ("model", "overrides"):
            continue  # a table is what it takes
        run = tmp_path / f"{flat}.toml"
        run.write_text(f"[{'.'.join(path[:-1])}]\n{path[-1]} = {{ nested = [1, 2] }}\n")
        code, err = _run(["train", "--config", str(run)])
        if code != 2 or "Traceback" in err or ".".join(path) not in err:
            failures.append((flat, code, err[-400:]))
    assert not failures, "\n".join(map(str, failures))
