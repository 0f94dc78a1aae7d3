"""Reading what the product writes: one event per line (logs are never wrapped off a terminal), so a
test finds the one line that says a thing, never text joined across lines."""
from __future__ import annotations


def line_with(text: str, *fragments: str) -> str:
    """The first line of `text` holding every fragment (AssertionError with the text's tail if none)."""
    for line in text.splitlines():
        if all(f in line for f in fragments):
            return line
    raise AssertionError(f"no line holds {fragments!r}:\n{text[-3000:]}")
