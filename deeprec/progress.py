"""Progress of long, quiet work (evaluation, `data synth`, export) on a terminal only.

    with progress("evaluate", unit="rows") as p:       # a spinner, rows done, rows/s
        for batch in reader:
            ...; p.advance(rows)
    with progress("synth", total=rows) as p:           # a bar: rows done of total, rows/s
    with progress("export", total=3, unit="stages") as p:
        p.stage("tracing"); ...; p.stage("writing")    # the stage under way, named

Drawn on the shared console (stderr) only when it is a terminal: logs, pipes and tests
stay clean. A progress opened while another (the trainer's) is live on the same console
is drawn beneath it (rich nests live displays of one console); `configure` lets the CLI
hand its console over, or switch progress off (--no-progress).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, SpinnerColumn, Task,
                           TextColumn, TimeElapsedColumn)
from rich.text import Text

from deeprec.console import make_console

_console: Console | None = None
_enabled = True


def configure(console: Console | None = None, *, enabled: bool = True) -> None:
    """The console progress is drawn on (None: a new one on stderr) and whether it is drawn at all."""
    global _console, _enabled
    _console, _enabled = console, enabled


def get_console() -> Console:
    global _console
    if _console is None:
        _console = make_console(stderr=True)
    return _console


class _Rate(ProgressColumn):
    """Items per second (rich's speed: a moving average over the last seconds)."""

    def __init__(self, unit: str):
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("" if speed is None else f"{speed:,.0f} {self.unit}/s", style="progress.data.speed")


class Tracker:
    """What a caller advances; does nothing when progress is not drawn."""

    def __init__(self, bar: Progress | None = None, task=None, description: str = ""):
        self._bar, self._task, self._description = bar, task, description
        self._staged = False

    @property
    def drawn(self) -> bool:
        return self._bar is not None

    def advance(self, n: float = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def stage(self, name: str) -> None:
        """Name the stage under way ("export: tracing"); the one before it counts as done."""
        if self._bar is not None:
            self._bar.update(self._task, advance=1 if self._staged else 0, description=f"{self._description}: {name}",
                             refresh=True)  # drawn now: a short stage would fall between two timed refreshes
        self._staged = True


@contextlib.contextmanager
def progress(description: str, total: float | None = None, *, unit: str = "rows", rate: bool = True,
             console: Console | bool | None = None, transient: bool = False) -> Iterator[Tracker]:
    """A progress display of `description` for the `with` block; `total` None: a spinner and a
    count; `rate`: show `unit`/s. `console`: False (none), a Console (drawn there if it is a
    terminal), None or True: the shared console (if a terminal and progress is not switched off)."""
    shared = console is None or console is True
    if console is False or (shared and not _enabled):
        yield Tracker()
        return
    target = get_console() if shared else console
    if not target.is_terminal:
        yield Tracker()
        return
    if total is None:
        columns = [SpinnerColumn(), TextColumn("{task.description}"), TextColumn("{task.completed:,.0f} " + unit)]
    else:
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit)]
    columns += [_Rate(unit)] * rate + [TimeElapsedColumn()]
    with Progress(*columns, console=target, transient=transient) as bar:
        yield Tracker(bar, bar.add_task(description, total=total), description)


__all__ = ["progress", "configure", "get_console", "Tracker"]
