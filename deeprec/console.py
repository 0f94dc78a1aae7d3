"""The consoles deeprec writes its messages on: rich's, less the hard wrap where no one reads a window.

On a terminal rich wraps a long message at the window's edge, as a person reading it wants. Written
to anything else (a pipe, a file, `deeprec launch`'s reader, a pod's log), a message stays one line
whatever its length: a log collector, `grep` or a person reading the log needs one event per line,
and rich would otherwise cut it at 80 columns (its width where there is no terminal), so that two
ranks' pieces interleave. Tables and other renderables keep their layout.
"""
from __future__ import annotations

from rich.console import Console
from rich.text import Text


class LogConsole(Console):
    """A rich Console whose `print` of messages (str, Text) does not wrap unless it writes to a terminal."""

    def print(self, *objects, soft_wrap: bool | None = None, **kwargs) -> None:
        if soft_wrap is None and not self.is_terminal and all(isinstance(o, (str, Text)) for o in objects):
            soft_wrap = True  # one message, one line
        super().print(*objects, soft_wrap=soft_wrap, **kwargs)


def make_console(stderr: bool = False, **kwargs) -> Console:
    """The console for deeprec's messages on stderr (or stdout): see the module's docstring."""
    return LogConsole(stderr=stderr, **kwargs)
