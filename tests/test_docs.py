"""Every shell command that README.md and docs/*.md show in a ```bash block runs, as written, in a
temporary working folder (and so does the README's Python example).

- One test per command, named by page, line and command, so a failure names the command.
  Commands of one page run in the page's order in one folder per page (a later command may use
  what an earlier one wrote: a checkpoint, an export); running one command alone runs the
  commands before it on its page first.
- The folder holds what the commands name: `day_0.tsv`, `day_1.tsv`, `day_2.tsv` (`deeprec data
  synth`), `behavior.tsv`, `my_clicks.csv`, the files of the pages' ```toml blocks whose first line
  is `# name.toml`, `examples/`, and `deeprec/` (a link to the package: the bundled samples are
  `deeprec/data/samples/`, as in the repository root).
  `DEEPREC_CACHE` points into the temporary folder; `DEEPREC_EXPORT_COMPILE=0`: exports hold the
  traced program only (the compiled packages of the zoo and of an own model are
  tests/test_serving_compiled.py's and tests/test_own_model.py's; one costs 20-60 s).
- Sizes: `--synthetic N` runs with at most 20,000 rows, `deeprec data synth --rows N` with at
  most 2,000, and `--steps N` with at most 100 (not under `timeout`, whose signal must land
  mid-run); nothing else is changed.
- `deeprec serve ...` is started on a free port (`--port 0`); the test waits for its
  `listening on` line, sends one request holding every input column of the export's schema, and
  stops it.
- `# exits N` after a command: N is its expected exit status (default 0).
- ```console and ```text blocks (make, torchrun, several machines, Kubernetes) are not run, by
  design; nor are other ```python blocks than the README's.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
MAX_SYNTHETIC = 20_000
MAX_SYNTH_ROWS = 2_000
MAX_STEPS = 100
TIMEOUT = 600


@dataclass
class Command:
    page: str
    line: int
    text: str  # as the page shows it (continuation lines joined)
    kind: str = "bash"  # or "python"
    expect: int = 0

    @property
    def id(self) -> str:
        short = re.sub(r"\s+", " ", self.text.strip())[:90]
        return f"{self.page}:{self.line}: {short}"


def fenced_blocks(path):
    """(language, first line number of the content, lines) of each fenced block of a page."""
    blocks, lang, start, body = [], None, 0, []
    with open(os.path.join(ROOT, path)) as f:
        for n, line in enumerate(f, 1):
            stripped = line.rstrip("\n")
            if lang is None and stripped.startswith("```"):
                lang, start, body = stripped[3:].strip() or "text", n + 1, []
            elif lang is not None and stripped.startswith("```"):
                blocks.append((lang, start, body))
                lang = None
            elif lang is not None:
                body.append(stripped)
    return blocks


def bash_commands(page, start, lines):
    out, buf, first = [], "", None
    for i, line in enumerate(lines):
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if first is None:
            first = start + i
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        m = re.search(r"#\s*exits (\d+)\s*$", buf)
        out.append(Command(page, first, buf.strip(), expect=int(m.group(1)) if m else 0))
        buf, first = "", None
    return out


def collect():
    commands, files = [], {}
    for page in PAGES:
        python_done = False
        for lang, start, lines in fenced_blocks(page):
            if lang == "bash":
                commands += bash_commands(page, start, lines)
            elif lang == "toml" and lines and re.fullmatch(r"#\s*[\w.-]+\.toml", lines[0].strip()):
                files[lines[0].strip().lstrip("#").strip()] = "\n".join(lines) + "\n"
            elif lang == "python" and page == "README.md" and not python_done:
                commands.append(Command(page, start, "\n".join(lines), kind="python"))
                python_done = True
    return commands, files


COMMANDS, TOML_FILES = collect()


def shrink(text: str) -> str:
    text = re.sub(r"--synthetic (\d+)", lambda m: f"--synthetic {min(int(m.group(1)), MAX_SYNTHETIC)}", text)
    if "data synth" in text:
        text = re.sub(r"--rows (\d+)", lambda m: f"--rows {min(int(m.group(1)), MAX_SYNTH_ROWS)}", text)
    if not text.startswith("timeout "):
        text = re.sub(r"--steps (\d+)", lambda m: f"--steps {min(int(m.group(1)), MAX_STEPS)}", text)
    return text


def my_clicks_csv(path, rows=2000):
    """Rows for docs/data.md's my_clicks.toml: clicked, user, item, history (item ids, '|')."""
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        f.write("clicked,user,item,history\n")
        for _ in range(rows):
            user, item = rng.randrange(200), rng.randrange(500)
            history = "|".join(str(rng.randrange(500)) for _ in range(rng.randrange(0, 8)))
            clicked = int((item % 7 == user % 7) or rng.random() < 0.1)
            f.write(f"{clicked},u{user},{item},{history}\n")


@dataclass
class Workspace:
    root: str
    env: dict
    results: dict = field(default_factory=dict)  # command id -> (ok, message)
    pages: set = field(default_factory=set)

    def folder(self, page: str) -> str:
        path = os.path.join(self.root, page.replace("/", "_").replace(".md", ""))
        if page not in self.pages:
            shutil.copytree(os.path.join(self.root, "base"), path, symlinks=True)
            self.pages.add(page)
        return path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from deeprec.data import write_behavior, write_synthetic

    root = str(tmp_path_factory.mktemp("docs"))
    base = os.path.join(root, "base")
    os.makedirs(base)
    # the package itself, as in the repository root: commands name deeprec/data/samples/..., and a
    # bare deeprec/ folder in the working folder would shadow the package for `python -m`
    os.symlink(os.path.join(ROOT, "deeprec"), os.path.join(base, "deeprec"))
    shutil.copytree(os.path.join(ROOT, "examples"), os.path.join(base, "examples"))
    for i in range(3):
        write_synthetic(os.path.join(base, f"day_{i}.tsv"), MAX_SYNTH_ROWS, cardinalities="kaggle", seed=i)
    write_behavior(os.path.join(base, "behavior.tsv"), MAX_SYNTH_ROWS, seed=0)
    my_clicks_csv(os.path.join(base, "my_clicks.csv"))
    for name, text in TOML_FILES.items():
        with open(os.path.join(base, name), "w") as f:
            f.write(text)
    env = dict(os.environ, DEEPREC_CACHE=os.path.join(root, "cache"), DEEPREC_EXPORT_COMPILE="0",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return Workspace(root, env)


def request_rows(export_dir: str) -> dict:
    """Two rows with every input column of the export's schema."""
    manifest = os.path.join(export_dir, "manifest.json")
    if not os.path.exists(manifest):  # a training's --export-dir: its newest full export
        fulls = sorted(d for d in os.listdir(export_dir) if d.startswith("full-"))
        manifest = os.path.join(export_dir, fulls[-1], "manifest.json")
    with open(manifest) as f:
        schema = json.load(f)["schema"]
    rows = {}
    for column in schema["column"]:
        kind, dtype = column["kind"], column.get("dtype", "string")
        if kind == "dense":
            rows[column["name"]] = [1.0, None]
        elif kind == "categorical":
            rows[column["name"]] = [1, 2] if dtype == "int" else ["a", "b"]
        elif kind == "sequence":
            rows[column["name"]] = [[1, 2], [3]] if dtype == "int" else [["a"], ["b", "c"]]
    return rows


def plain_argv(text: str, env: dict) -> list[str] | None:
    """A plain `deeprec ...` command (no shell syntax but single quotes and a comment) as the argv bash execs,
    the program found on env's PATH; None for anything else."""
    bare = re.sub(r"'[^']*'", "''", text).split(" #")[0]  # single quotes only: bash expands in double ones
    if not re.match(r"deeprec\s", bare) or re.search(r"[|&;<>$`()*?\[\]{}~\\\n\"]", bare) or "#" in bare:
        return None
    argv = shlex.split(text, comments=True)
    program = shutil.which(argv[0], path=env.get("PATH"))
    return [program, *argv[1:]] if program else None


def serve(cmd: Command, cwd: str, env: dict) -> tuple[bool, str]:
    import httpx

    argv = plain_argv(shrink(cmd.text), env)
    assert argv, cmd.text
    if "--port" in argv:
        argv[argv.index("--port") + 1] = "0"
    else:
        argv += ["--port", "0"]
    model_dir = argv[argv.index("serve") + 1]
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith("listening on http://"):
            proc.kill()
            return False, f"no 'listening on' line: {line!r}\n{proc.stderr.read()[-3000:]}"
        url = line.split()[-1]
        health = httpx.get(f"{url}/healthz", timeout=60)
        answer = httpx.post(f"{url}/v1/predict", json={"inputs": request_rows(os.path.join(cwd, model_dir))},
                            timeout=60)
        if health.status_code != 200 or answer.status_code != 200 or len(answer.json()["scores"]) != 2:
            return False, f"healthz {health.status_code}; predict {answer.status_code}: {answer.text[:2000]}"
        return True, answer.text
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def execute(cmd: Command, cwd: str, env: dict) -> tuple[bool, str]:
    if cmd.kind == "python":
        argv = [sys.executable, "-c", cmd.text]
    elif re.match(r"deeprec serve\b", cmd.text):
        return serve(cmd, cwd, env)
    else:
        # a plain deeprec command runs as bash would exec it (without bash: tests/prefork.py forks it)
        argv = plain_argv(shrink(cmd.text), env) or ["bash", "-c", shrink(cmd.text)]
    started = time.monotonic()
    try:
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {TIMEOUT} s"
    took = time.monotonic() - started
    if done.returncode != cmd.expect:
        return False, (f"exit {done.returncode} (expected {cmd.expect}) after {took:.0f} s\n"
                       f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-4000:]}")
    return True, done.stdout[-500:]


def run_in_order(workspace: Workspace, cmd: Command) -> tuple[bool, str, list]:
    """Run the commands of cmd's page before it (once), then cmd; (ok, message, earlier failures)."""
    cwd = workspace.folder(cmd.page)
    failed_before = []
    for other in (c for c in COMMANDS if c.page == cmd.page):
        if other.id not in workspace.results:
            workspace.results[other.id] = execute(other, cwd, workspace.env)
        if other is cmd:
            break
        if not workspace.results[other.id][0]:
            failed_before.append(other.id)
    ok, message = workspace.results[cmd.id]
    return ok, message, failed_before


def test_the_docs_have_commands():
    pages = {c.page for c in COMMANDS}
    assert "README.md" in pages and any(c.kind == "python" for c in COMMANDS)
    assert len(pages) >= 8, pages


@pytest.mark.slow
@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.id for c in COMMANDS])
def test_command_runs(workspace, cmd):
    ok, message, failed_before = run_in_order(workspace, cmd)
    if not ok:
        earlier = "".join(f"\n(an earlier command of the page failed: {f})" for f in failed_before)
        pytest.fail(f"{cmd.id}\n{message}{earlier}", pytrace=False)
