"""How `make test` hands the tests to its pytest-xdist workers (`--dist loadfile`, which this plugin
refines): in work units, the longest first.

    collection (each worker) ──sorted: longest unit first (tests/durations.json)──┐
    controller: unit = scope_of(test) ── one unit at a time to the first free worker ┘

A unit is a test file (its tests share module fixtures and run on one worker), except in the files
of SPLIT, whose units are smaller: test_docs.py one page each (a page's commands run in order in
one folder; pages are independent) and test_serving_compiled.py one compiled model each. Without
the split, those two files alone ran 13 and 16 minutes on one worker each.

A long unit started last would run alone at the end while the other worker idles: hence the
longest first, from the last measured run (tests/durations.py writes durations.json from a JUnit
report). pytest-xdist's own `--dist loadgroup` would do the split from markers, but 3.8 cannot mark
groups under pytest 9 (its nodeid rewrite sets an attribute pytest 9 no longer reads).
"""
from __future__ import annotations

import json
import os
import re

import pytest
from xdist.scheduler import LoadScopeScheduling

HERE = os.path.dirname(os.path.abspath(__file__))
DURATIONS = os.path.join(HERE, "durations.json")
DEFAULT_SECONDS = 10.0


def _docs_page(test: str) -> str | None:
    """test_command_runs[docs/serving.md:288: deeprec ...] -> docs/serving.md"""
    m = re.match(r"test_command_runs\[([^:\]]+):\d+:", test)
    return m and m.group(1)


def _compiled_model(test: str) -> str | None:
    """test_the_package_scores_as_the_exported_program[dlrm-table] -> dlrm-table"""
    m = re.match(r"test_the_package_scores_as_the_exported_program\[(.+)\]$", test)
    return m and m.group(1)


SPLIT = {"test_docs": _docs_page, "test_serving_compiled": _compiled_model}


def scope_of(module: str, test: str) -> str:
    """The work unit of test `test` (its name, with parameters) of the test module `module`
    (test_docs): the module, or module::part where SPLIT splits the module."""
    split = SPLIT.get(module)
    part = split(test) if split else None
    return f"{module}::{part}" if part else module


def _scope_of_nodeid(nodeid: str) -> str:
    """tests/test_docs.py[::Class]::test_x[params] -> scope_of("test_docs", "test_x[params]") (a
    parameter id may hold "::": a docs command with --host ::)."""
    path, _, test = nodeid.partition("::")
    name, bracket, params = test.partition("[")
    return scope_of(os.path.splitext(os.path.basename(path))[0], name.rpartition("::")[2] + bracket + params)


def load_durations() -> dict[str, float]:
    try:
        with open(DURATIONS) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def sort_longest_first(items, seconds: dict[str, float] | None = None) -> None:
    """Orders the collected items by their unit's duration (`seconds`, default: the last run's), the
    longest first; a unit's items stay together and in collection order (what module fixtures and
    test_docs' page order rely on)."""
    seconds = load_durations() if seconds is None else seconds
    units = {item: _scope_of_nodeid(item.nodeid) for item in items}
    order = {unit: i for i, unit in enumerate(dict.fromkeys(units.values()))}
    position = {item: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-seconds.get(units[item], DEFAULT_SECONDS), order[units[item]], position[item]))


class UnitScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with scope_of's units, in collection order (the longest first: xdist
    would reorder them by their number of tests), handed out one at a time: a worker gets the next
    unit when its own has one test left (xdist's loadscope hands out two at the start, which can
    leave a long unit queued behind another on a busy worker while the other one idles)."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        return _scope_of_nodeid(nodeid)

    def _reschedule(self, node) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 1:
            return
        self._assign_work_unit(node)


@pytest.hookimpl(optionalhook=True)  # a run without xdist (-p no:xdist) has no such hook
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadfile":
        return UnitScheduling(config, log)
    return None
