"""The seconds each group of tests took (tests/durations.json), read from a JUnit XML report:
    .venv/bin/python -m pytest -n auto --dist loadgroup --junitxml=run.xml && python tests/durations.py run.xml

conftest.py hands xdist the groups longest first (a long file started last would run alone at the
end while the other workers idle). A group is a test file, or for test_docs.py one page's commands.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import xml.etree.ElementTree as ElementTree

HERE = os.path.dirname(os.path.abspath(__file__))
DURATIONS = os.path.join(HERE, "durations.json")


def group_of(module: str, params: str = "") -> str:
    """A test's group: its file, or for a test_docs.py command its page (the id starts 'page:line: ')."""
    if module.endswith("test_docs") and params:
        return f"{module}:{params.split(':', 1)[0]}"
    return module


def main(report: str) -> None:
    seconds: collections.Counter = collections.Counter()
    for case in ElementTree.parse(report).iter("testcase"):
        name = case.get("name", "")
        params = name[name.index("[") + 1:] if "[" in name else ""
        seconds[group_of(case.get("classname", "").rpartition(".")[2], params)] += float(case.get("time", 0))
    with open(DURATIONS, "w") as f:
        json.dump({k: round(v, 1) for k, v in seconds.most_common()}, f, indent=0)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
