"""Waits on a state, never on a number of seconds: a test polls what it waits for, with a deadline
that only bounds a failure (it is never what the test waits for)."""
from __future__ import annotations

import os
import time


def wait_until(condition, timeout: float, what: str, poll: float = 0.05):
    """condition()'s first truthy value, waited for at most `timeout` s (AssertionError naming `what`)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f}s")
        time.sleep(poll)


def group_stopped(pgid: int) -> bool:
    """Every process of the process group `pgid` is stopped (SIGSTOP taken: state T)."""
    states = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid:
            states.append(fields[0])
    return bool(states) and all(s in "tT" for s in states)
